"""Forced runs of the reimplementation: local vs inherited error, and each op on the reference's inputs.

The reimplementation reruns every block on the *reference's* input to that block (and the final
norm and lm_head on the reference's own inputs). A point's error in that run is what the
candidate's computation introduces there (`local_rel_l2`); the rest of its error in the plain
run is inherited from upstream. An injected fault in one block is then local to that block even
though every later block inherits it.
"""

from __future__ import annotations

import torch

from tracer.llama import Llama, decoder_layer, layer_positions
from tracer.points import EMBED, FINAL_LOGITS, FINAL_NORM, LOGITS, layer_point
from tracer.trace import Trace, TraceRecorder


@torch.inference_mode()
def teacher_forced_points(llama: Llama, reference: Trace, recorder=None):
    """The candidate's points (point -> tensor, recording order) with every block fed the
    reference's input to that block."""
    recorder = recorder if recorder is not None else TraceRecorder()
    w, spec, strategies = llama.weights, llama.spec, llama.strategies

    def reference_input(point: str) -> torch.Tensor:
        return reference[point][None].to(dtype=strategies.dtype, device=llama.device)  # (1, T, C)

    tokens = torch.tensor(reference.tokens, device=llama.device)
    embedded = strategies.embed(tokens[None], w["model.embed_tokens.weight"], spec)  # (1, T, C)
    recorder(EMBED, embedded)
    positions = layer_positions(spec, strategies, tokens.shape[0], embedded.dtype, llama.device)
    block_input = EMBED
    for i, layer in enumerate(llama.layers):
        if block_input not in reference:
            break
        decoder_layer(reference_input(block_input), layer, spec, positions[i], strategies, layer_point(i, ""),
                      recorder)
        block_input = layer_point(i, "")
    last_block = layer_point(spec.num_hidden_layers - 1, "")
    if last_block in reference:
        recorder(FINAL_NORM, strategies.norm(reference_input(last_block), w["model.norm.weight"], spec.rms_norm_eps))
    if FINAL_NORM in reference:
        recorder(LOGITS, strategies.logits(reference_input(FINAL_NORM), w["lm_head.weight"]))
    if LOGITS in reference and spec.final_logit_softcapping is not None:  # Gemma 2's capped logits
        recorder(FINAL_LOGITS, strategies.softcap(reference_input(LOGITS), spec.final_logit_softcapping))
    return recorder.tensors


class ForcingRecorder:
    """A recorder that, after keeping each point (a copy), overwrites the forward's tensor in place
    with the reference's value of that point: every later op then reads the reference's input.

    Points the reference lacks, or holds in another shape (fewer rows, another layout), run on as
    computed and are listed in `unforced`.
    """

    def __init__(self, reference: Trace, recorder=None):
        self.reference, self.recorder = reference, recorder if recorder is not None else TraceRecorder()
        self.unforced: list[str] = []

    @property
    def tensors(self):
        return self.recorder.tensors

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self.recorder(name, tensor.clone())
        given = self.reference[name] if name in self.reference else None
        if given is None or tuple(given.shape) != tuple(tensor.shape[1:]):
            self.unforced.append(name)
            return
        tensor.copy_(given[None].to(dtype=tensor.dtype, device=tensor.device))


@torch.inference_mode()
def op_forced_points(llama: Llama, reference: Trace, recorder=None):
    """The candidate's points with every op fed the reference's values of its inputs (a finer
    teacher forcing than `teacher_forced_points`: inside a block too). A point's error is then its
    op's alone: where the ops round to 8 bits (a quantized regime), a tiny difference upstream in
    the same block can no longer flip a rounding and pass for the op's own error."""
    forcing = ForcingRecorder(reference, recorder)
    llama.forward(torch.tensor(reference.tokens), forcing)
    return forcing.tensors
