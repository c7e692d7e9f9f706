"""The inputs of a pool's GEMMs quantized as its serving kernels quantize them (W8A8, W4A4).

:func:`~mixrl.rl.quant.quantize_model_` gives a model its pool's weights; real FP8 and FP4 kernels
also quantize what they multiply those weights by (:data:`~mixrl.rl.quant.ACTIVATION_SCHEMES`,
docs/precisions.md "Activations").  :func:`install_` turns each linear layer whose weight is
quantized into an :class:`InputQuantLinear` (the same module and parameters, another class) and
each Qwen3-MoE experts module into :class:`InputQuantExperts`, whose forward quantizes the input of
both expert GEMMs.  Kept layers (embeddings, LM head, norms, the MoE router, FP4 layers of an odd
width) keep their inputs, as in the kernels.

NVFP4 also needs each input's per-tensor scale, calibrated once per weight version as deployment
does it (ModelOpt's max calibration): :meth:`ModelInputs.calibrate` runs a calibration batch with
the inputs passing unquantized and records each one's max |x|.  The batch is
:data:`CALIBRATION_ROWS` × :data:`CALIBRATION_TOKENS` token ids drawn with a fixed seed — a stand-in
for the few hundred text samples a deployment calibrates on (no dataset can be downloaded here),
the same for every version.  Inputs that share one GEMM in the kernels (q/k/v, gate/up) see the
same tensor and so get the same scale; an experts module has one per projection over all its
experts (the fused MoE kernel takes one).

Pure torch: no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from mixrl.rl.quant import ACTIVATION_SCHEMES, fusion_group, quantize_activation, quantize_model_

ACTIVATION_MODES = ("auto", "off")
"""``auto``: a pool's GEMM inputs are quantized as its precision's kernels do (none for bf16);
``off``: only its weights (and KV cache) are."""

CALIBRATION_ROWS = 8
CALIBRATION_TOKENS = 64
CALIBRATION_SEED = 0


class InputQuant:
    """One GEMM input's quantizer: ``fmt``'s activation scheme, or recording max |x| while calibrating.

    The layers a serving stack fuses into one GEMM (q/k/v, gate/up) share one quantizer, and their
    common input is quantized once: the first of the ``members`` calls quantizes it, the others
    (the same tensor, unmodified) take the result, and the last lets it go."""

    def __init__(self, fmt: str, members: int = 1) -> None:
        self.fmt = fmt
        self.members = members
        self.amax: Tensor | None = None
        """The calibrated max |x| (nvfp4's per-tensor scale is amax / (6 · 448))."""
        self.calibrating = False
        self.observed: Tensor | None = None
        self._held: tuple[Tensor, Tensor] | None = None
        self._uses = 0

    def __call__(self, x: Tensor) -> Tensor:
        # The same tensor object: the members run one after another on their block's input, which
        # nothing writes to in between (inference tensors keep no version counter to check).
        held = self._held
        if held is not None and held[0] is x:
            out, self._uses = held[1], self._uses + 1
        else:
            out, self._uses = self._quantize(x), 1
            self._held = (x, out)
        if self._uses >= self.members:
            self._held = None
        return out

    def _quantize(self, x: Tensor) -> Tensor:
        if self.calibrating:
            seen = x.detach().abs().amax().to(torch.float32)
            self.observed = seen if self.observed is None else torch.maximum(self.observed, seen)
            return x
        return quantize_activation(x, self.fmt, amax=self.amax)


class InputQuantLinear(nn.Linear):
    """A linear layer whose input is quantized first (its weight already is)."""

    input_quant: InputQuant

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(self.input_quant(input), self.weight, self.bias)


class InputQuantExperts(Qwen3MoeExperts):
    """Qwen3-MoE experts whose two GEMMs get quantized inputs (None: that projection is kept).

    The same loop as transformers' forward; the gate/up input is quantized once for all experts
    (every scheme's scales are per token, so a token's quantized row does not depend on which
    expert it is routed to)."""

    gate_up_input: InputQuant | None
    down_input: InputQuant | None

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        final = torch.zeros_like(hidden_states)
        hidden = self.gate_up_input(hidden_states) if self.gate_up_input else hidden_states
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert])
            gate, up = F.linear(hidden[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            inner = self.act_fn(gate) * up
            if self.down_input:
                inner = self.down_input(inner)
            out = F.linear(inner, self.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


@dataclass
class ModelInputs:
    """The quantized inputs of one model, by name: a linear layer's name, or an experts module's
    name with ``.gate_up_proj`` / ``.down_proj``."""

    fmt: str
    quantizers: dict[str, InputQuant]

    @property
    def needs_calibration(self) -> bool:
        return self.fmt == "nvfp4"

    @torch.no_grad()
    def calibrate(self, model: nn.Module) -> dict[str, Tensor]:
        """Each input's max |x| over the calibration batch, the inputs passing unquantized."""
        config: Any = model.config
        vocab = int(config.vocab_size)
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        ids = torch.randint(0, vocab, (CALIBRATION_ROWS, CALIBRATION_TOKENS), generator=generator)
        device = next(model.parameters()).device
        for quantizer in self.quantizers.values():
            quantizer.calibrating, quantizer.observed = True, None
        try:
            model(input_ids=ids.to(device), use_cache=False)
        finally:
            for quantizer in self.quantizers.values():
                quantizer.calibrating = False
        unseen = sorted(name for name, q in self.quantizers.items() if q.observed is None)
        if unseen:
            raise RuntimeError(f"calibration: no input reached {unseen[0]!r}")
        return {name: q.observed for name, q in self.quantizers.items() if q.observed is not None}

    def check(self, amax: dict[str, Tensor]) -> None:
        """Raise ValueError unless ``amax`` holds a positive finite maximum for every input."""
        for name in self.quantizers:
            value = amax.get(name)
            if value is None or value.numel() != 1 or not 0 < float(value) < float("inf"):
                raise ValueError(f"input amax of {name!r}: expected one positive finite number, got {value}")

    def set_amax(self, amax: dict[str, Tensor]) -> None:
        """Serve with these calibrated maxima (a version's, from :meth:`calibrate`)."""
        self.check(amax)
        for name, quantizer in self.quantizers.items():
            quantizer.amax = amax[name].detach().to(torch.float32).reshape(())

    def calibrated(self, model: nn.Module) -> None:
        """Calibrate ``model`` and serve with the result (nothing to do for dynamic schemes)."""
        if self.needs_calibration:
            self.set_amax(self.calibrate(model))


def install_(model: nn.Module, fmt: str, quantized: list[str]) -> ModelInputs | None:
    """Quantize the inputs of the layers named in ``quantized`` (quantize_model_'s report) as
    ``fmt``'s kernels do; None when nothing is (bf16, or no quantized layer).  Idempotent: the
    layers already installed keep their quantizers (and are returned whatever ``quantized`` says)."""
    if ACTIVATION_SCHEMES.get(fmt) is None:
        return None
    chosen = set(quantized)
    members = Counter(group for name in chosen if (group := fusion_group(name)))
    shared: dict[str, InputQuant] = {}
    quantizers: dict[str, InputQuant] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (name in chosen or isinstance(module, InputQuantLinear)):
            linear: Any = module
            if not isinstance(module, InputQuantLinear):
                group = fusion_group(name)
                if group is None:
                    quantizer = InputQuant(fmt)
                elif group in shared:
                    quantizer = shared[group]
                else:
                    quantizer = shared[group] = InputQuant(fmt, members[group])
                linear.__class__ = InputQuantLinear
                linear.input_quant = quantizer
            quantizers[name] = linear.input_quant
        elif any(p.ndim == 3 for p in module.parameters(recurse=False)):
            gate_up, down = f"{name}.0.gate_proj" in chosen, f"{name}.0.down_proj" in chosen
            if not (gate_up or down or isinstance(module, InputQuantExperts)):
                continue
            if not isinstance(module, Qwen3MoeExperts):
                raise ValueError(
                    f"activation quantization: experts module {name!r} ({type(module).__name__}) is "
                    "not supported (Qwen3-MoE is); serve it with --activation-quant off"
                )
            experts: Any = module
            if not isinstance(module, InputQuantExperts):
                experts.__class__ = InputQuantExperts
                experts.gate_up_input = InputQuant(fmt) if gate_up else None
                experts.down_input = InputQuant(fmt) if down else None
            for projection, quantizer in (
                ("gate_up_proj", experts.gate_up_input),
                ("down_proj", experts.down_input),
            ):
                if quantizer is not None:
                    quantizers[f"{name}.{projection}"] = quantizer
    return ModelInputs(fmt, quantizers) if quantizers else None


CHECKPOINT_CALIBRATION_MAX_PARAMS = 2_000_000_000
"""Above this many parameters a checkpoint is not calibrated on the converter's CPU (float32: 8 GB
and minutes per version); its NVFP4 ``input_scale`` stays the uncalibrated default."""


@torch.no_grad()
def calibrate_checkpoint(config: dict[str, Any], tensors: dict[str, Tensor], fmt: str) -> dict[str, Tensor]:
    """The calibrated input maxima of a checkpoint served at ``fmt``: the model built from its
    ``config.json`` on the CPU, its (BF16) tensors loaded and quantized as the engine quantizes
    them, then :meth:`ModelInputs.calibrate`.  Empty for a format with dynamic scales only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    model_config = AutoConfig.for_model(config["model_type"], **fields)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).eval()
    model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=True)
    for param in model.parameters():
        param.copy_(param.to(torch.bfloat16).to(param.dtype))
    inputs = install_(model, fmt, quantize_model_(model, fmt)["quantized"])
    return inputs.calibrate(model) if inputs and inputs.needs_calibration else {}


def checkpoint_input_name(module: str) -> str:
    """The calibrated input a checkpoint module reads: its own, or for one expert's projection the
    experts module's (``….experts.3.up_proj`` → ``….experts.gate_up_proj``)."""
    parent, _, projection = module.rpartition(".")
    experts, _, index = parent.rpartition(".")
    if experts.endswith(".experts") and index.isdigit():
        return f"{experts}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
    return module
