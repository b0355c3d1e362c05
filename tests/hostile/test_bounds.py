"""User-given sizes past what makes sense are refused in one line before anything is allocated: a packing length
or a cost report's length of a trillion tokens grew to 22 GB, or ended in an OverflowError traceback; a trillion
data-parallel ranks ended in a MemoryError traceback; a hundred thousand encode processes were asked of the pool."""

from __future__ import annotations

import resource

import pytest
from support.caches import EXAMPLE_SLICES

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import main
from sft_tokenize.read.length_costs import length_costs
from sft_tokenize.read.packing_index import PackOptions


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(tmp_path_factory.mktemp("root")))))


@pytest.mark.parametrize("args", [["pack", "{cache}", "--length", "1000000000000"],
                                  ["inspect", "{cache}", "--lengths", "--at", "1000000000000"],
                                  ["export", "{cache}", "{out}", "--to", "megatron", "--pack-length", "1000000000000"]])
def test_a_length_of_a_trillion_tokens_is_refused_in_one_line(cache, args, tmp_path, capsys):
    grown_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = main([a.format(cache=cache, out=tmp_path / "out") for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "1,000,000,000,000 tokens is past the longest sequence this tool packs or costs (4,194,304)" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown_before < 200_000  # KiB: nothing was built
    assert not (tmp_path / "out").exists()  # nothing was exported


def test_the_python_api_bounds_the_same_lengths(cache):
    with pytest.raises(ValueError, match="less than or equal to 4194304"):
        PackOptions(length=10**12)
    import pyarrow as pa

    with pytest.raises(ValueError, match="length 1,000,000,000,000: a cost report's lengths are 1 to 4,194,304"):
        length_costs(pa.table({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}), at=[10**12])
    assert main(["pack", cache, "--length", str(2**22)]) == 0  # the bound itself is packed


def test_data_parallel_ranks_past_any_cluster_are_refused_in_one_line(cache, capsys):
    """Each rank gets as many bins as the others, empty ones where rows run out: ranks are allocated for."""
    grown_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = main(["pack", cache, "--length", "4096", "--data-parallel", "1000000000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "1,000,000,000,000 data-parallel ranks is past the most this tool packs for (1,048,576)" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown_before < 200_000  # KiB: nothing was built
    with pytest.raises(ValueError, match="less than or equal to 1048576"):
        PackOptions(length=4096, data_parallel=10**12)
    assert PackOptions(length=4096, data_parallel=2**20).data_parallel == 2**20  # the bound itself is allowed


def test_encode_processes_past_the_bound_are_refused_before_any_is_started(tmp_path, capsys):
    """The encode pool forks every process it is asked for at once: a slip of the keyboard would fork thousands."""
    code = main(["run", EXAMPLE_SLICES["sources"][0], "--tokenizer", EXAMPLE_SLICES["tokenizer"],
                 "--cache-dir", str(tmp_path), "--encode-processes", "100000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--encode-processes: 100,000 encode processes is past the most a run starts (256)" in err, err
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir()), err
    from sft_tokenize import tokenize

    with pytest.raises(Exception, match="encode-processes: .*less than or equal to 256"):
        tokenize(**EXAMPLE_SLICES, cache_dir=str(tmp_path), encode_processes=100_000)
