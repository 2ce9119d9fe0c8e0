"""The compile sweep's step sizes and summary (the sweep itself needs a CUDA engine: its
plumbing, the worker's compile list read by RPC, is the same on CPU, where nothing compiles)."""

import pytest

from benchmarks.profiling.compile_sweep import Compile, Probe, SweepReport, step_sizes, summary


def test_step_sizes_cover_every_small_size_and_each_bucket_top_and_offsets():
    sizes = step_sizes(8192, extra_random=0)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 8192
    assert set(range(1, 41)) <= set(sizes)
    for p in (64, 512, 4096, 8192):
        assert {p, p - 1, p - 2, p - 16, p - 33} <= set(sizes)
    assert all(1 <= n <= 8192 for n in step_sizes(8192, extra_random=50))


def test_step_sizes_stop_at_a_limit_that_is_no_power_of_two():
    sizes = step_sizes(1000, extra_random=0)
    assert max(sizes) == 1000 and {999, 967} <= set(sizes) and 1024 not in sizes


def test_summary_lists_the_sizes_that_compiled_per_kind():
    report = SweepReport(warmup_counts=[1, 2], warmup_s=1.0, probes=[
        Probe(kind="base", tokens=300, seconds=1.2, compiles=[Compile(kernel="k", ms=900.0, key="x")]),
        Probe(kind="base", tokens=301, seconds=0.1),
        Probe(kind="8 adapters", tokens=64, seconds=0.1)])
    text = summary(report)
    assert "base: 2 step sizes probed, 1 compiled something (1 kernels, 0.9 s): 300" in text
    assert "8 adapters: 1 step sizes probed, 0 compiled something" in text


def test_adapters_are_a_folder_of_folders_or_one_folder_used_eight_times(tmp_path):
    from benchmarks.profiling.compile_sweep import adapter_folders

    def fail(msg):
        raise ValueError(msg)

    one = tmp_path / "one"
    one.mkdir()
    (one / "adapter_config.json").write_text("{}")
    assert adapter_folders(one, fail) == {f"one-{i}": one for i in range(8)}
    many = tmp_path / "many"
    for i in range(9):
        (many / f"a{i}").mkdir(parents=True)
        (many / f"a{i}" / "adapter_config.json").write_text("{}")
    (many / "not-an-adapter").mkdir()
    assert list(adapter_folders(many, fail)) == [f"a{i}" for i in range(8)]
    for i in range(9):
        (many / f"a{i}" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="holds 0 adapter folders"):
        adapter_folders(many, fail)


def test_a_compile_is_explained_by_the_warmed_variant_nearest_to_it():
    """Keys as Triton writes them: the nearest warmed variant of the same kernel and the positions
    that differ; another kernel's variants are not compared; a kernel never warmed says so."""
    from benchmarks.profiling.compile_sweep import nearest_warmed

    warmed = [Compile(kernel="gemm", ms=1.0, key="[('*bf16', 'D'), ('i32', ''), ('constexpr', 4)]"),
              Compile(kernel="gemm", ms=1.0, key="[('*bf16', 'D'), ('i32', 'D'), ('constexpr', 1)]"),
              Compile(kernel="other", ms=1.0, key="[('*bf16', 'D'), ('i32', 'D'), ('constexpr', 4)]")]
    new = Compile(kernel="gemm", ms=1800.0, key="[('*bf16', 'D'), ('i32', 'D'), ('constexpr', 4)]")
    index, diff = nearest_warmed(new, warmed)
    assert index in (0, 1) and len(diff) == 1
    assert diff[0] in [(1, ("i32", ""), ("i32", "D")), (2, ("constexpr", 1), ("constexpr", 4))]
    longer = Compile(kernel="gemm", ms=1.0, key="[('*bf16', 'D'), ('i32', ''), ('constexpr', 4), ('constexpr', 8)]")
    assert nearest_warmed(longer, warmed) == (0, [(3, None, ("constexpr", 8))])
    assert nearest_warmed(Compile(kernel="never", ms=1.0, key="[]"), warmed) is None
    report = SweepReport(warmup_counts=[1], warmup_s=1.0, warmup_compiles=warmed[:1], probes=[
        Probe(kind="base", tokens=1554, seconds=2.0, compiles=[new])])
    assert "n=1554 gemm: the nearest warmed variant differs at 1 key position(s): [1] warmed ('i32', ''), " \
           "here ('i32', 'D')" in summary(report)
