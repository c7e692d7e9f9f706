"""One rank of the tensor-parallel seam test (run as a script by test_tp_seam.py).

usage: tp_worker.py RANK WORLD INIT_FILE INPUT.pt OUTPUT.pt

Joins a gloo group through INIT_FILE, takes its contiguous slice of the vocabulary, runs the
objective on that slice (logits and chunked LM head) with ``vocab_group`` set, and saves its loss,
metrics and gradients for the parent to compare with the unsharded run.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from mixrl.rl.corrections import CorrectionConfig, LossTokens, chunked_token_policy_loss, token_policy_loss


def main(argv: list[str]) -> int:
    rank, world, init_file, input_path, output_path = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        data = torch.load(input_path)
        vocab = data["logits"].shape[1]
        bounds = [round(i * vocab / world) for i in range(world + 1)]
        start, stop = bounds[rank], bounds[rank + 1]
        group = dist.group.WORLD
        results = []
        for config_kwargs in data["configs"]:
            config = CorrectionConfig(**config_kwargs)
            logits = data["logits"][:, start:stop].clone().requires_grad_(True)
            loss, metrics = token_policy_loss(
                logits,
                LossTokens(**data["records"]),
                config,
                data["loss_mask"],
                vocab_group=group,
                vocab_start=start,
            )
            loss.backward()
            hidden = data["hidden"].clone().requires_grad_(True)
            head = data["head"][start:stop].clone().requires_grad_(True)
            chunked, _ = chunked_token_policy_loss(
                hidden,
                head,
                LossTokens(**data["records"]),
                config,
                data["loss_mask"],
                chunk_size=3,
                temperature=0.7,
                vocab_group=group,
                vocab_start=start,
            )
            chunked.backward()
            results.append(
                {
                    "loss": loss.detach(),
                    "grad": logits.grad,
                    "metrics": metrics.per_token,
                    "chunked_loss": chunked.detach(),
                    "grad_hidden": hidden.grad,
                    "grad_head": head.grad,
                }
            )
        torch.save({"start": start, "stop": stop, "results": results}, output_path)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
