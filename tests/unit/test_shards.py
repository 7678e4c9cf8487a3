"""Tensor-parallel shards (one dump per rank, or SGLang's dumper directory) merged by their declared
layout and compared with the reference (`tracer.traces.shards`): shards cut from a real hf trace
of a tiny Llama the way a 2-GPU vLLM/SGLang run splits it, the row-parallel partial sums computed
from the model's own o_proj/down_proj weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

import tracer
from tests.conftest import TOKENS
from tests.dumps import save_dump
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.model.points import has_head_axis, split_point
from tracer.traces.shards import COLUMN_SPLIT

RANKS = 2
ROW_SPLIT = ("self_attn.o_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(reference trace, its per-rank slices as dicts point -> tensor, weights, folder)."""
    from tests.conftest import write_tiny_llama

    folder = tmp_path_factory.mktemp("shards")
    model = write_tiny_llama(folder / "model")
    reference = tracer.record(model, TOKENS, engine="hf", progress=False)
    weights = load_file(str(model / "model.safetensors"))
    ranks = [{} for _ in range(RANKS)]
    for point, tensor in reference.tensors.items():
        layer, sub = split_point(point)
        if sub in ROW_SPLIT:  # what each rank's matmul gives before the all-reduce: its input columns' share
            inputs = reference.tensors[f"model.layers.{layer}." + ("self_attn.context" if "attn" in sub else "mlp.act")]
            weight = weights[f"{point}.weight"]
            for rank, (x, w) in enumerate(zip(inputs.chunk(RANKS, dim=-1), weight.chunk(RANKS, dim=-1))):
                ranks[rank][point] = x @ w.T  # (T, C): a partial sum
        elif sub in COLUMN_SPLIT:
            for rank, part in enumerate(tensor.chunk(RANKS, dim=0 if has_head_axis(point) else -1)):
                ranks[rank][point] = part.contiguous()
        else:
            for rank in range(RANKS):
                ranks[rank][point] = tensor.clone()
    return reference, ranks, weights, folder


def write_ranks(ranks, folder, *, layout=None, rank_keys=True, edit=None):
    paths = []
    for rank, tensors in enumerate(ranks):
        tensors = dict(tensors)
        if edit is not None:
            edit(rank, tensors)
        metadata = {"tp_rank": rank, "tp_size": RANKS} if rank_keys else {}
        if layout is not None:
            metadata["tp_layout"] = json.dumps(layout)
        paths.append(save_dump(tensors, folder / f"rank{rank}.safetensors", TOKENS, runtime="vllm", **metadata))
    return paths


ROW_LAYOUT = {"self_attn.o_proj": "row", "mlp.down_proj": "row"}


def test_shards_merged_by_their_declared_layout_match_the_reference(sharded, tmp_path):
    reference, ranks, _, _ = sharded
    result = tracer.compare_files(reference, write_ranks(ranks, tmp_path, layout=ROW_LAYOUT))
    assert result.verdict == "match"
    by_point = {p.point: p.rel_l2 for p in result.points}
    assert len(by_point) == len(reference.tensors)
    row = [rel for point, rel in by_point.items() if split_point(point)[1] in ROW_SPLIT]
    assert len(row) == 4 and 0 < max(row) < 1e-6  # partial sums added: the matmul's rounding, not more
    assert all(rel == 0 for point, rel in by_point.items() if split_point(point)[1] not in ROW_SPLIT)
    assert any("2 tensor-parallel shards merged: " in note and "row 4 points" in note for note in result.notes)


def test_partial_sums_taken_as_replicated_read_as_a_missing_all_reduce(sharded, tmp_path):
    reference, ranks, _, _ = sharded
    result = tracer.compare_files(reference, write_ranks(ranks, tmp_path))  # the default: o_proj all-reduced
    assert result.verdict == "diverged"
    assert result.first_divergence.point == "model.layers.0.self_attn.o_proj"
    assert any("model.layers.0.self_attn.o_proj: declared replicated, but the ranks differ" in note
               for note in result.notes)


def test_a_damaged_slice_of_one_rank_is_named(sharded, tmp_path):
    reference, ranks, _, _ = sharded

    def damage(rank, tensors):
        if rank == 1:
            tensors["model.layers.1.self_attn.k_proj"] = tensors["model.layers.1.self_attn.k_proj"] * 1.01

    result = tracer.compare_files(reference, write_ranks(ranks, tmp_path, layout=ROW_LAYOUT, edit=damage))
    first = result.first_divergence
    assert first.point == "model.layers.1.self_attn.k_proj"
    slice_ = ranks[1]["model.layers.1.self_attn.k_proj"].double()
    full = reference.tensors["model.layers.1.self_attn.k_proj"].double()
    assert first.rel_l2 == pytest.approx(0.01 * float(slice_.norm() / full.norm()), rel=1e-3)  # rank 1's heads 1 % off


def test_ranks_in_a_runtimes_layout_and_order(sharded, tmp_path):
    """q/k after RoPE dumped (T, H/N, D) as vLLM holds them, a batch axis, the files given in reverse
    order: merged along the heads axis, put in rank order."""
    reference, ranks, _, _ = sharded

    def runtime_layout(rank, tensors):
        for point in [p for p in tensors if p.endswith(("q_rope", "k_rope"))]:
            tensors[point] = tensors[point].transpose(0, 1).contiguous()[None]  # (1, T, H/N, D)

    paths = write_ranks(ranks, tmp_path, layout=ROW_LAYOUT, edit=runtime_layout)
    result = tracer.compare_files(reference, list(reversed(paths)))
    assert result.verdict == "match"
    assert max(p.rel_l2 for p in result.points if p.point.endswith("q_rope")) == 0


def test_the_users_layout_file_wins_and_unknown_keys_are_said(sharded, tmp_path, capsys):
    reference, ranks, _, _ = sharded
    ref_path = reference.save(tmp_path / "hf.safetensors")
    paths = write_ranks(ranks, tmp_path)  # the dumps declare nothing
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({**ROW_LAYOUT, "model.layers.{i}.mlp.experts": "column"}))
    code = main(["compare", str(ref_path), *map(str, paths), "--shard-layout", str(layout), "--json", "-",
                 "--no-report", "--fail-on-divergence"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["verdict"] == "match"
    assert any("shard layouts that name no point of the shards: model.layers.{i}.mlp.experts" in note
               for note in payload["notes"])


@pytest.mark.parametrize("change, message", [
    (dict(tp_rank=0), "the shards' tp_rank must be 0..1, one each"),
    (dict(tp_size=4), "2 shards were given, but they declare tensor-parallel sizes .*rank0.safetensors: 2, "
                      ".*rank1.safetensors: 4"),
    (dict(tp_layout=json.dumps({"self_attn.o_proj": "rows"})),
     "self_attn.o_proj: shard layout 'rows'; expected column"),
])
def test_inconsistent_shards_are_one_line(sharded, tmp_path, change, message):
    reference, ranks, _, _ = sharded
    paths = write_ranks(ranks, tmp_path)
    tensors = load_file(str(paths[1]))
    save_dump(tensors, paths[1], TOKENS, **{"tp_rank": 1, "tp_size": RANKS, **change})
    with pytest.raises(TracerError, match=message):
        tracer.compare_files(reference, paths)


def test_a_layout_for_one_trace_and_a_column_split_of_unequal_slices_are_refused(sharded, tmp_path):
    reference, ranks, _, _ = sharded
    with pytest.raises(TracerError, match="neither side is a set of tensor-parallel shards"):
        tracer.compare_files(reference, reference, shard_layout=ROW_LAYOUT)

    def uneven(rank, tensors):
        if rank == 1:
            tensors["model.layers.0.self_attn.q_proj"] = tensors["model.layers.0.self_attn.q_proj"][:-1]

    with pytest.raises(TracerError, match=r"model.layers.0.self_attn.q_proj: the ranks' slices .* differ off the "
                                          r"split axis"):
        tracer.compare_files(reference, write_ranks(ranks, tmp_path, edit=uneven))


def test_an_sglang_dumper_directory(sharded, tmp_path):
    """SGLang's dumper files ({"value", "meta"} per tensor and rank, named by their tags), with `dims`
    declaring the splits; a second forward (step 1) in the directory is left out and said."""
    reference, ranks, _, _ = sharded
    dump = tmp_path / "dump_1733390000"
    dump.mkdir()
    index = 0
    for step in (0, 1):
        for rank, tensors in enumerate(ranks):
            for point, tensor in tensors.items():
                layer, sub = split_point(point)
                dims = ("t h(tp,partial)" if sub in ROW_SPLIT else "h(tp) t d" if sub in COLUMN_SPLIT
                        and has_head_axis(point) else "t f(tp)" if sub in COLUMN_SPLIT else "t h")
                index += 1
                meta = {"step": step, "rank": rank, "dump_index": index, "name": f"non_intrusive__{point}.output",
                        "dims": dims, "sglang_parallel_info": {"tp_rank": rank, "tp_size": RANKS}}
                if layer is not None:
                    meta["layer_id"] = layer
                tags = "___".join(f"{k}={meta[k]}" for k in ("step", "rank", "dump_index", "name"))
                torch.save({"value": tensor, "meta": meta}, dump / f"{tags}.pt")
            tags = f"step={step}___rank={rank}___dump_index=0___name=input_ids"
            torch.save({"value": torch.tensor(TOKENS), "meta": {"name": "input_ids", "step": step}},
                       dump / f"{tags}.pt")
    result = tracer.compare_files(reference, dump)
    assert result.verdict == "match"
    assert len(result.points) == len(reference.tensors)
    assert any("SGLang dump: step 0 compared, steps 1 left out" in note for note in result.notes)
    assert any("row 4 points" in note for note in result.notes)


def test_a_directory_that_is_no_dump_is_one_line_and_exit_2(sharded, tmp_path, capsys):
    reference, ranks, _, _ = sharded
    ref_path = reference.save(tmp_path / "hf.safetensors")
    folder = tmp_path / "ranks"
    folder.mkdir()
    write_ranks(ranks, folder)
    assert main(["compare", str(ref_path), str(folder), "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory: shards are one trace file per rank, or one SGLang dumper" in err[0]
