"""Is the filetree task learnable by a tiny model on a CPU, first by imitation, then by RL?

Measures, in one process and one run:
1. the warm start (:class:`WarmStartRecipe`): time, and held-out success of the result;
2. the same number of supervised steps on careful demonstrations only: how far imitation alone
   can take the model (the task is learnable; the recipe's moderate start is the demonstrator's);
3. RL from the warm start: on-policy GRPO (group-normalized advantages, REINFORCE on the
   generated tokens, AdamW with gradient clipping) with episodes sampled by the real agent loop on
   the in-process sampler.  This GRPO is a stand-in written here for the measurement, not mixrl's
   trainer: no off-policy corrections (sampler and learner are the same fp32 model, so the ratio
   is 1), no engines, no buffer.  It answers one question: does held-out pass@1 rise by 15 points
   within the quickstart's budget of updates?

Held-out success is pass@1 estimated from ``--eval-samples`` samples on each of ``--eval-tasks``
held-out tasks, sampled like the quickstart (temperature 1, top-p 0.95, top-k 32).

    .venv/bin/python bench/rollout_learnability.py            # about 2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import Trajectory
from mixrl.rl.environments.filetree import FileTreeEnvironment, FileTreeTask, generate_tasks
from mixrl.rl.rollout.agent import run_episode, summarize_evaluation
from mixrl.rl.rollout.demos import WarmStartRecipe, warm_start_recipe
from mixrl.rl.rollout.local_sampler import LocalSampler
from mixrl.rl.rollout.tokenizer import Tokenizer
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model


def quickstart_sampling(max_new_tokens: int = 16) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        top_p=0.95,
        top_k=32,
        max_new_tokens=max_new_tokens,
        top_logprobs_num=0,
        return_sampling_mask=False,
    )


async def play(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    tasks: list[FileTreeTask],
    samples: int,
    sampling: SamplingParams,
    seed: int,
    max_turns: int = 6,
    max_context: int = 256,
) -> list[list[Trajectory]]:
    model.eval()
    environment = FileTreeEnvironment()
    async with LocalSampler(
        model,
        tokenizer.stop_token_ids,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=seed,
        pad_id=tokenizer.pad_id,
    ) as sampler:
        flat = await asyncio.gather(
            *[
                run_episode(
                    sampler.generate,
                    environment,
                    task,
                    tokenizer,
                    sampling,
                    max_turns,
                    max_context,
                    3,
                    sample_index=i,
                )
                for task in tasks
                for i in range(samples)
            ]
        )
    return [flat[i * samples : (i + 1) * samples] for i in range(len(tasks))]


def heldout_pass1(
    model: torch.nn.Module, tokenizer: Tokenizer, tasks: list[FileTreeTask], samples: int, seed: int
) -> float:
    groups = asyncio.run(play(model, tokenizer, tasks, samples, quickstart_sampling(), seed))
    return summarize_evaluation(groups, [1])["pass_at_k"]["1"]


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[list[Trajectory]],
    pad_id: int,
    clip: float,
) -> float:
    """One on-policy update: advantage = (r - group mean) / group std on every generated token."""
    rewards = torch.tensor([[t.reward or 0.0 for t in g] for g in groups], dtype=torch.float64)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    flat = [t for g in groups for t in g]
    width = max(len(t.prompt_ids) + len(t.tokens) for t in flat)
    ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    weight = torch.zeros((len(flat), width), dtype=torch.float64)
    for row, (t, a) in enumerate(zip(flat, advantages.flatten().tolist(), strict=True)):
        sequence = t.prompt_ids + t.tokens
        ids[row, : len(sequence)] = torch.tensor(sequence)
        start = len(t.prompt_ids)
        weight[row, start : len(sequence)] = torch.tensor(t.loss_mask, dtype=torch.float64) * a
    model.train()
    logits = model(input_ids=ids).logits[:, :-1].double()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(logp * weight[:, 1:]).sum() / sum(t.num_generated for t in flat)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(rewards.mean())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--skip-careful", action="store_true", help="skip the careful-demonstrations run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = Tokenizer.filetree()
    recipe = WarmStartRecipe()
    heldout = generate_tasks(args.seed, args.eval_tasks, "heldout")
    print(f"tiny qwen3 (hidden 64, 2 layers), vocab {tokenizer.vocab_size}; recipe {recipe.as_dict()}")

    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_checkpoint(f"{tmp}/m", "qwen3", tokenizer.vocab_size, seed=args.seed)
        if not args.skip_careful:
            careful = load_model(path)
            started = time.monotonic()
            report = warm_start_recipe(
                careful, tokenizer, args.seed, recipe=WarmStartRecipe(mistake_rate=0.0)
            )
            success = heldout_pass1(careful, tokenizer, heldout, args.eval_samples, args.seed)
            print(
                f"careful demonstrations only: {report.steps} steps in {time.monotonic() - started:.1f}s, "
                f"held-out pass@1 {success:.3f}"
            )
        model = load_model(path)
        started = time.monotonic()
        report = warm_start_recipe(model, tokenizer, args.seed, recipe=recipe)
        warm_seconds = time.monotonic() - started
        baseline = heldout_pass1(model, tokenizer, heldout, args.eval_samples, args.seed)
        print(
            f"warm start (recipe): {report.steps} steps in {warm_seconds:.1f}s, probe success "
            f"{report.success:.3f}, held-out pass@1 {baseline:.3f}"
        )

    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    train = generate_tasks(
        args.seed, recipe.demonstrations + recipe.probe_tasks + args.prompts * args.rl_steps, "train"
    )[recipe.demonstrations + recipe.probe_tasks :]
    started = time.monotonic()
    final = baseline
    for step in range(1, args.rl_steps + 1):
        prompts = train[(step - 1) * args.prompts : step * args.prompts]
        groups = asyncio.run(
            play(model, tokenizer, prompts, args.samples, quickstart_sampling(), args.seed + step)
        )
        reward = grpo_step(model, optimizer, groups, tokenizer.pad_id, clip=1.0)
        if step % args.eval_every == 0 or step == args.rl_steps:
            final = heldout_pass1(model, tokenizer, heldout, args.eval_samples, args.seed)
            elapsed = time.monotonic() - started
            print(
                f"RL step {step}/{args.rl_steps}: train reward {reward:.2f}, held-out pass@1 {final:.3f} "
                f"({100 * (final - baseline):+.1f} points), {elapsed:.0f}s, "
                f"ETA {elapsed / step * (args.rl_steps - step):.0f}s"
            )
    print(
        f"result: held-out pass@1 {baseline:.3f} -> {final:.3f}, {100 * (final - baseline):+.1f} points "
        f"after {args.rl_steps} updates of {args.prompts}x{args.samples} episodes at lr {args.lr}"
    )


if __name__ == "__main__":
    main()
