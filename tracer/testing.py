"""`assert_traces_close`: a port's test suite asks tracer where it diverges, in three lines.

    from tracer.testing import assert_traces_close

    def test_port_matches_transformers():
        assert_traces_close("hf.safetensors", "port-dump.safetensors")

In the spirit of `torch.testing.assert_close`, but the failure message names the operation:
the first diverging point with its figures, the last point that agrees, the logits, and what
could not be compared.
"""

from __future__ import annotations

from tracer.api import compare_files
from tracer.reports.terminal import terminal_summary


def assert_traces_close(reference, candidate, *, atol: float | None = None, rtol: float | None = None,
                        aliases=None) -> None:
    """Assert that two traces agree at every point both have.

    Args:
        reference, candidate: `Trace`s, paths to safetensors files (tracer's own or another
            runtime's dump, see docs/trace-format.md), or dicts name -> tensor.
        atol, rtol: elementwise `|c - r| <= atol + rtol·|r|` instead of the default criterion
            (relative L2 error above 1e-4 diverges).
        aliases: extra name mapping (dict, JSON file path, or AliasTable) for the dumps.

    Raises:
        AssertionError: a point diverged; the message is tracer's localized finding.
        TracerError: the traces cannot be compared (different token ids, unreadable file,
            shapes that cannot be reconciled).

    Example:
        >>> ref = tracer.record(None, "The capital of France is", engine="hf", progress=False)
        >>> port = {f"my_out-{i}": t for i, t in enumerate(ref[f"model.layers.{i}"] for i in range(30))}
        >>> port["tokens"] = torch.tensor(ref.tokens)
        >>> assert_traces_close(ref, port, aliases={"my_out-{i}": "model.layers.{i}"})  # a dump with its own names
    """
    result = compare_files(reference, candidate, atol=atol, rtol=rtol, aliases=aliases)
    if not result:
        raise AssertionError("traces are not close\n" + terminal_summary(result))
