"""What the engine needs from a model family: the `Adapter` interface.

The engine knows no architecture. An adapter resolves the parts of a stock Hugging
Face `...ForCausalLM` (unwrapping PEFT), allocates the family's prompt state, and runs
T tokens from a given position against that state, appending to it (capture) or only
reading it (replay). It calls the model's own submodules throughout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from longstraw.errors import ModelStateError, UnsupportedModelError
from longstraw.parallel.fsdp import manages_no_parameter
from longstraw.state.branch import BranchState
from longstraw.state.offload import settle
from longstraw.state.prompt import PromptState

from .experts import is_sharded
from .peft_layers import check_peft
from .pieces import mlp_pieces, piece as _piece
from .recompute import recomputed_layers
from .rope import pinned_rope, rotary_of
from .routing import AttentionCall, Divided, DividedChunk, Phase, forwards_replaced, run_backbone
from .vision import check_prompt_inputs, check_text_responses, vision_tower

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without distributed
    FSDPModule = None


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face `...ForCausalLM` inside `model` (PEFT wrappers are unwrapped;
    their injected LoRA layers stay in place and keep working)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "config") or not hasattr(base.config, "model_type"):
        raise UnsupportedModelError(f"expected a Hugging Face ...ForCausalLM, got {type(base).__name__}")
    return base


def _is_fsdp_module(module: nn.Module) -> bool:
    return FSDPModule is not None and isinstance(module, FSDPModule)


def chunked_mlps(layers, size: int, pieces: int | None = None):
    """Within the block (a divided capture, phase DIVIDED), each decoder layer's `mlp` runs
    over pieces of `size` tokens (`mlp_pieces`), so a layer's working set is the attention
    projections of the shard plus one MLP piece. `pieces` (expert parallelism, whose MoE
    calls are collectives that every rank must make alike): run exactly that many, the
    last ones empty where this rank has fewer.
    (DeepSeek's and GLM-5's MoE routers compute their logits in float32, and one token
    takes BLAS's matrix-vector path, which rounds differently from the matrix products of
    a chunked capture.)"""
    mlps = [layer.mlp for layer in layers if hasattr(layer, "mlp")]

    def chunked(forward):
        def run(x):  # x [1, N, d]
            n = x.shape[1]
            starts = mlp_pieces(n, size)
            starts += [n] * ((pieces or 0) - len(starts))  # empty pieces: the ranks' collectives pair up
            if len(starts) == 1:
                with _piece(0, size):
                    return forward(x)
            outs = []
            for i, (a, b) in enumerate(zip(starts, starts[1:] + [n])):
                with _piece(i, size):
                    outs.append(forward(x[:, a:b]))
            out = torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)
            # an MLP returning (output, router scores), gpt-oss's: its layer drops the scores
            return (out, None) if isinstance(outs[0], tuple) else out
        return run
    return forwards_replaced(mlps, [chunked(m.forward) for m in mlps])


class Adapter:
    """Base adapter. Subclasses set `model_types` and implement `new_state` and
    `new_branch_state`; one that replaces module forwards overrides `routing`."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model
        self.causal_lm = unwrap_causal_lm(model)
        if not hasattr(self.causal_lm, "model") or self.causal_lm.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"expected a Hugging Face ...ForCausalLM with .model and an lm_head, got {type(self.causal_lm).__name__}"
            )
        self.config = self.causal_lm.config
        self.backbone = self.causal_lm.model
        if hasattr(self.backbone, "language_model") and not hasattr(self.backbone, "layers"):
            # a multimodal ...ForConditionalGeneration (e.g. Qwen3.5): run its text model on text prompts
            self.backbone = self.backbone.language_model
            self.config = self.backbone.config
        if not hasattr(self.backbone, "layers"):
            raise UnsupportedModelError(
                f"{type(self.causal_lm).__name__}.model ({type(self.backbone).__name__}) has no decoder .layers; pass "
                "the text ...ForCausalLM (or a ...ForConditionalGeneration whose .model has a .language_model)"
            )
        self.lm_head = self.causal_lm.get_output_embeddings()
        self.vision = vision_tower(self.causal_lm)  # images in the prompt (`vision.py`); None: text only
        self.check_config()
        check_peft(self.model)
        rotary_of(self.backbone)  # refuses a length-dependent RoPE it could not pin

    # --- facts the engine validates against --------------------------------

    @property
    def embeddings(self) -> nn.Embedding:
        """The input embedding table (the one inside PEFT's trainable-tokens wrapper, if any)."""
        emb = self.backbone.get_input_embeddings()
        return getattr(emb, "original_module", None) or emb

    @property
    def vocab_size(self) -> int:
        return self.embeddings.num_embeddings

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    def check_config(self) -> None:
        """Refuse config features the adapter cannot run exactly (override to add)."""

    def check_inputs(self, prompt: torch.Tensor | None, prompt_inputs, responses=(),
                     what: str = "group.responses") -> None:
        """Refuse a prompt's non-text inputs (`Group.prompt_inputs`) the model cannot run,
        and image tokens in `responses` (named `what`; `vision.py`), before any work."""
        if prompt is not None:
            check_prompt_inputs(self.vision, getattr(self.causal_lm.config, "model_type", None), prompt,
                                prompt_inputs)
        check_text_responses(self.vision, responses, what)

    def encode_inputs(self, prompt: torch.Tensor, prompt_inputs, cp=None):
        """The prompt's images through the model's own tower, once, without grad, and its
        M-RoPE positions (a `state.vision.PromptImages`); None for a text prompt. `cp`:
        context parallelism, the images dealt over its ranks (`vision.deal_images`)."""
        if prompt_inputs is None:
            return None
        return self.vision.encode(prompt, prompt_inputs, self.dtype, self.device, cp)

    def backprop_inputs(self, images, prompt_inputs, cp=None) -> None:
        """Exact mode, after the reverse walk: the images' accumulated gradient through the
        tower, one image at a time (`vision.VisionTower.backprop`; `cp`: a divided walk's,
        whose image-row gradient is partial on each rank)."""
        if images is not None:
            self.vision.backprop(images, prompt_inputs, cp)

    def check_context_parallel(self, total_positions: int) -> None:
        """Refuse what context parallelism cannot run exactly (override to add)."""

    def sharded_modules(self) -> list[nn.Module]:
        """The model's modules wrapped with FSDP2 `fully_shard` that manage parameters
        (empty without FSDP2; not `parallel.sharding.shard_model`'s root, which manages none)."""
        return [m for m in self.model.modules() if _is_fsdp_module(m) and not manages_no_parameter(m)]

    def check_runnable(self) -> None:
        """Refuse model states we cannot reproduce exactly; called before each step."""
        if _is_fsdp_module(self.causal_lm) and not manages_no_parameter(self.causal_lm):
            raise UnsupportedModelError(
                "the ...ForCausalLM itself is wrapped with FSDP2 fully_shard over its own parameters; LongStraw "
                "calls its decoder stack and lm_head directly, so the root's hooks would never gather them. Use "
                "longstraw.parallel.sharding.shard_model(model, mesh): the decoder layers sharded, the root over "
                "no parameter (the embeddings, final norm and lm_head replicated)"
            )
        check_peft(self.model)  # an adapter may have been added or switched since construction
        if getattr(self.causal_lm, "is_activation_checkpointing", False):
            raise ModelStateError(
                "gradient checkpointing is enabled on the model; LongStraw bounds activation memory itself. "
                "Call model.gradient_checkpointing_disable() first."
            )
        if self.model.training:
            dropouts = [name for name, m in self.model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
            attn_p = float(getattr(self.config, "attention_dropout", 0.0) or 0.0)
            if dropouts or attn_p > 0:
                where = dropouts[0] if dropouts else f"config.attention_dropout={attn_p}"
                raise ModelStateError(
                    f"the model is in train mode with dropout > 0 ({where}); dropout would differ between "
                    "capture and replay. Call model.eval() (or set dropout to 0)."
                )

    # --- the work ------------------------------------------------------------

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        """Empty state for `positions` tokens from absolute position `start` (the
        prompt: P - 1 tokens from 0; a branch's pieces: from P - 1). `exact` keeps
        everything a reverse walk needs to recompute each chunk. `shard`
        (context parallelism) keeps only this rank's per-token rows. `host` (state
        offload) allocates the per-token rows (K/V, MLA latents, indexer keys) in host
        memory (`state.HOST`); constant-size state stays on the model's device."""
        raise NotImplementedError

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        """Empty per-branch state for a rollout of `branches` branches of up to `capacity`
        tokens each, continuing `prompt` (a captured prompt state): its first row is
        absolute position prompt.start + prompt.length (P - 1)."""
        raise NotImplementedError

    def routing(self):
        """A context manager within which the family's own modules run through LongStraw
        (the attention function is routed by `run_backbone` for every family)."""
        return contextlib.nullcontext()

    divides_capture: bool = False
    """Whether a context-parallel capture may run divided (phase DIVIDED,
    `parallel/divided.py`): each prompt token computed on one rank. Families without it
    capture replicated."""

    divides_walk: bool = False
    """Whether exact mode's reverse walk may run divided under context parallelism
    (`routing.DividedChunk`): each prompt token recomputed and backpropagated on one rank.
    Families without it walk replicated."""

    batches_replay: bool = False
    """Whether replay may run B branches as one batch (`ExecConfig.replay_batch`, phase
    REPLAY with input_ids [B, T]): every mixer of the family takes a batch against the
    shared prompt state. Families without it refuse `replay_batch > 1`."""

    restarts_at_chunks: bool = False
    """Whether the family's recompute restarts from snapshots capture kept at multiples of
    `chunk_size` (GDN layers), so that a divided walk cuts the prompt only there."""

    def divided_pieces(self, divided: Divided) -> int | None:
        """A divided capture under expert parallelism: the MLP pieces every rank runs (the
        most any rank's positions need), else None (each rank its own)."""
        if not is_sharded(self.backbone):
            return None
        return max(len(mlp_pieces(divided.deal.count(divided.total, r), divided.chunk_size))
                   for r in range(divided.world))

    def run(self, input_ids: torch.Tensor, start: int, states: list[PromptState], *, phase: Phase | str,
            block_size: int, branches: BranchState | None = None, rows: list[int] | None = None,
            divided: Divided | DividedChunk | None = None, positions: list[int] | None = None,
            recompute_layers: bool = False) -> torch.Tensor:
        """Run tokens input_ids [T] at positions start .. start+T-1 against `states`
        (stacked, earliest first: the prompt state, then any earlier branch pieces).
        `phase` is a `routing.Phase` (or its name as a string):

        CAPTURE: write their state into states[-1] (the caller holds no_grad).
        REPLAY: only read the states. input_ids may be a batch [B, T] of branches at the same
        positions (`batches_replay`): hidden [B, T, d] then.
        RECOMPUTE: read what lies before `start` and record the chunk's own state tensors
        with their accumulated gradients in `states[-1].seeds`.
        DECODE: input_ids [G] are one token per branch, all at position `start`, or each at
        its own, `positions` [G] (`start` then their least); they read `states` and append
        to `branches` (the caller holds no_grad). `rows`: the branches run (input_ids then
        [len(rows)]), None: all G.
        DIVIDED: input_ids [N] are this rank's own prompt positions (`divided`, a
        `routing.Divided`), the whole prompt at once, layer by layer (the caller holds
        no_grad); they append to states[-1]. RECOMPUTE with `divided` (a
        `routing.DividedChunk`): input_ids [n] are this rank's positions of the chunk
        from `start` (a divided reverse walk).
        `recompute_layers` (a run with autograd: replay's pieces, exact mode's walk
        chunks, divided or not): each decoder layer keeps only its input and is
        recomputed in backward (`recompute.py`).
        Returns final hidden states [T, d] ([G, d] for decode), after the final norm,
        ready for the lm_head.
        """
        phase = Phase(phase)
        if divided is not None:
            positions = divided.positions(input_ids.device)
        elif positions is not None:
            assert phase is Phase.DECODE and len(positions) == input_ids.shape[0], "positions: one per decoded branch"
            positions = None if len(set(positions)) == 1 else torch.tensor(positions, device=input_ids.device)
        call = AttentionCall(states=states, start=start, phase=phase, block_size=block_size, branches=branches,
                             rows=rows, positions=positions, divided=divided)
        pieces = chunked_mlps(self.backbone.layers, divided.chunk_size, self.divided_pieces(divided)) \
            if phase is Phase.DIVIDED else contextlib.nullcontext()
        if recompute_layers and torch.is_grad_enabled() and phase is not Phase.DIVIDED:
            pieces = recomputed_layers(self, call)
        with self.routing(), pieces, pinned_rope(self.backbone, states[0].rope_length):
            hidden = run_backbone(self.backbone, self.config, input_ids, call)
        settle(states)  # offloaded states: capture's rows are on host before anyone reads them there
        return hidden
