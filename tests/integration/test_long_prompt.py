"""A 1024-token run on the bundled model in bounded memory: under 4 GB resident.

Long enough for everything a long prompt changes (the points spilled to a temporary folder past 256
tokens, attention matrices kept for their last 128 query rows, the cheap noise floor measured on the
first 256 tokens in a run of their own, the first divergence confirmed by the exact floor of layer 0),
and for the bound to tell: a run that kept its attention matrices whole would hold
4.5 GB of them (two traces of 30 layers, each with two 9 × 1024 × 1024 f32 matrices). The bound
holds with the allocator setting the `tracer` command makes (`tracer.core.allocator`: freed attention
matrices are kept for reuse); docs/memory.md has the measured peaks at 2048 tokens.
"""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import OWN_PEAK_KB

TEXT = (Path(__file__).resolve().parents[1] / "data" / "porting.txt").read_text()


def test_1024_tokens_in_bounded_memory(default_model, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text((TEXT + "\n") * 4)  # ~1230 tokens, cut to 1024
    args = ["run", "--prompt-file", str(prompt), "--max-tokens", "1024", "--variant", "theta=10000",
            "--no-report", "--json", "-"]
    # The CLI in a child that reports its own peak resident size (kB) on stderr at exit.
    wrapper = ("import sys; from tracer.cli import console_main\n"
               "try:\n    code = console_main()\n"
               f"finally:\n    print('PEAK', {OWN_PEAK_KB}, file=sys.stderr)\n"
               "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    peak_kb = int(proc.stderr.rsplit("PEAK", 1)[1].split()[0])
    payload = json.loads(proc.stdout)
    assert len(payload["tokens"]) == 1024
    assert payload["first_divergence"]["point"] == "model.layers.0.self_attn.q_rope"
    assert any("last 128 query rows" in note for note in payload["notes"])
    assert any("temporary folder" in note for note in payload["notes"])
    scores = next(p for p in payload["points"] if p["point"] == "model.layers.0.self_attn.scores")
    assert scores["shape"] == [9, 128, 1024]
    floor = payload["floor"]
    assert (floor["rows"], floor["tokens"], floor["exact_through"]) == (256, 1024, "model.layers.0.self_attn.q_rope")
    assert peak_kb < 4_000_000, f"peak resident {peak_kb / 1e6:.2f} GB"
