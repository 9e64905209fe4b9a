"""Tuning tables: loading (located errors), bucket selection, the native launch geometry, the tuner's rewrite."""

import types

import pytest

from generator import specs as S
from runtime import seed_compat
from bench import tune
from runtime.backends.native import NativeBackend


def _config(**kw):
    """A stand-in for the op's config: the launch fields given, no seed geometry."""
    ns = types.SimpleNamespace(**{name: None for name in seed_compat.SEED_FIELDS}, **kw)
    ns.launch_override = lambda role, tokens, wave: seed_compat.launch_override(ns, role, tokens, wave)
    return ns


def _write(spec_copy, text):
    (spec_copy / "tuning.toml").write_text(text)


def _table(target_lines):
    roles = {("sm_90", r): ["max_tokens = 0\nblocks = 0\nthreads = 512"] for r in S.TUNING_ROLES}
    roles.update(target_lines)
    out = []
    for t in ("gfx942", "gfx950", "gfx1250"):
        for r in S.TUNING_ROLES:
            out.append(f"[[tuning.{t}.{r}]]\nmax_tokens = 0\nblocks = 0\nthreads = 512\n")
    for (t, r), bodies in roles.items():
        out += [f"[[tuning.{t}.{r}]]\n{b}\n" for b in bodies]
    return "\n".join(out)


def test_buckets_select_by_tokens(spec_copy):
    _write(spec_copy, _table({("sm_90", "dispatch"): ["max_tokens = 128\nblocks = 32\nthreads = 256",
                                                      "max_tokens = 0\nblocks = 0\nthreads = 512"]}))
    specs = S.load(spec_copy)
    assert S.geometry(specs, "sm_90", "dispatch", 1) == S.Bucket(max_tokens=128, blocks=32, threads=256)
    assert S.geometry(specs, "sm_90", "dispatch", 128).blocks == 32
    assert S.geometry(specs, "sm_90", "dispatch", 129) == S.Bucket(max_tokens=0, blocks=0, threads=512)


@pytest.mark.parametrize("bodies,message", [
    (["max_tokens = 0\nblocks = 0\nthreads = 100"], "multiple of the wave size"),
    (["max_tokens = 0\nblocks = 0\nthreads = 2048"], "at most 1024"),
    (["max_tokens = 128\nblocks = 0\nthreads = 512"], "only the last bucket"),
    (["max_tokens = 256\nblocks = 0\nthreads = 512", "max_tokens = 128\nblocks = 0\nthreads = 512",
      "max_tokens = 0\nblocks = 0\nthreads = 512"], "must ascend"),
    (["max_tokens = 0\nblocks = -1\nthreads = 512"], ">= 0"),
    (["max_tokens = 0\nblocks = 0\nthreads = 512\nwarps = 4"], "unknown key 'warps'"),
    (["max_tokens = 0\nblocks = 0\nthreads = 512\nrows = \"warp\""], "rows"),
    (["world = 8\nmax_tokens = 0\nblocks = 0\nthreads = 512"], "needs buckets without `world`"),
    (["max_tokens = 0\nblocks = 0\nthreads = 512", "world = 8\nmax_tokens = 64\nblocks = 0\nthreads = 512"],
     r"only the last bucket \(world = 8\) has max_tokens = 0"),
    (["max_tokens = 0\nblocks = 0\nthreads = 512", "world = 4\nmax_tokens = 64\nblocks = 0\nthreads = 512",
      "world = 4\nmax_tokens = 32\nblocks = 0\nthreads = 512", "world = 4\nmax_tokens = 0\nblocks = 0\nthreads = 512"],
     r"buckets \(world = 4\) must ascend"),
    (["world = -2\nmax_tokens = 0\nblocks = 0\nthreads = 512"], r"world = -2: must be >= 0"),
])
def test_bad_tables_are_located(spec_copy, bodies, message):
    _write(spec_copy, _table({("sm_90", "dispatch"): bodies}))
    with pytest.raises(S.SpecError, match=message) as e:
        S.load(spec_copy)
    assert "tuning.toml:" in str(e.value)


def test_block_rows_only_for_dispatch(spec_copy):
    _write(spec_copy, _table({("sm_90", "dispatch"): ['max_tokens = 128\nblocks = 0\nthreads = 256\nrows = "block"',
                                                      "max_tokens = 0\nblocks = 0\nthreads = 512"]}))
    specs = S.load(spec_copy)
    assert S.geometry(specs, "sm_90", "dispatch", 100).rows == "block"
    assert S.geometry(specs, "sm_90", "dispatch", 200).rows == "wave"  # the default
    _write(spec_copy, _table({("sm_90", "combine"): ['max_tokens = 0\nblocks = 0\nthreads = 512\nrows = "block"']}))
    with pytest.raises(S.SpecError, match="only dispatch copies rows") as e:
        S.load(spec_copy)
    assert "tuning.toml:" in str(e.value)


def test_unknown_target_and_missing_role(spec_copy):
    _write(spec_copy, _table({("sm_80", "dispatch"): ["max_tokens = 0\nblocks = 0\nthreads = 512"]}))
    with pytest.raises(S.SpecError, match="unknown target 'sm_80'"):
        S.load(spec_copy)
    text = _table({}).replace("[[tuning.gfx950.combine]]\nmax_tokens = 0\nblocks = 0\nthreads = 512\n", "")
    _write(spec_copy, text)
    with pytest.raises(S.SpecError, match=r"no \[\[tuning.gfx950.combine\]\] buckets"):
        S.load(spec_copy)


def test_tuner_rewrite_round_trip(spec_copy):
    path = spec_copy / "tuning.toml"
    new = {"dispatch": tune.buckets_from({128: (32, 256, "block"), 4096: (64, 512, "wave")}),
           "combine": tune.buckets_from({128: (16, 512), 4096: (0, 512)})}
    text = tune.rewrite(path, "sm_90", new)
    path.write_text(text)
    specs = S.load(spec_copy)
    assert S.geometry(specs, "sm_90", "dispatch", 100) == S.Bucket(max_tokens=128, blocks=32, threads=256, rows="block")
    assert S.geometry(specs, "sm_90", "dispatch", 8192) == S.Bucket(max_tokens=0, blocks=64, threads=512)
    assert S.geometry(specs, "sm_90", "combine", 1).blocks == 16
    assert specs.tuning[("gfx950", "dispatch")] == S.load().tuning[("gfx950", "dispatch")]
    assert text.startswith("# Launch geometry")  # the header comment is kept


def test_native_geometry_takes_table_and_override(spec_copy, monkeypatch):
    # a table of known buckets: dispatch up to 128 tokens 32 blocks x 256 threads, then the whole GPU x 512;
    # combine the whole GPU x 512 (blocks = 0: one per multiprocessor)
    _write(spec_copy, _table({("sm_90", "dispatch"): ["max_tokens = 128\nblocks = 32\nthreads = 256",
                                                      "max_tokens = 0\nblocks = 0\nthreads = 512"]}))
    import runtime.backends.native as native

    specs = S.load(spec_copy)
    monkeypatch.setattr(native, "load_specs", lambda: specs)
    occupancy = {"dispatch": 1, "combine": 1}  # resident blocks per multiprocessor, as the driver says
    fake = types.SimpleNamespace(arch="sm_90", num_sms=132, wave=32, _dispatch_converts=False,
                                 config=_config(launch_blocks=0, launch_threads=0, launch_rows="wave", world_size=2),
                                 k={"dispatch": types.SimpleNamespace(blocks_per_sm=lambda t: occupancy["dispatch"]),
                                    "combine": types.SimpleNamespace(blocks_per_sm=lambda t: occupancy["combine"])})
    fake._block_rows = lambda tokens: NativeBackend._block_rows(fake, tokens)
    geo = NativeBackend._geometry
    assert geo(fake, "combine", 4096, 4096) == (132, 512)  # one block per SM (occupancy 1)
    # dispatch, 256 threads = 8 waves a block, a row per wave: no more blocks than the rows need
    assert geo(fake, "dispatch", 1, 8) == (1, 256)  # 8 rows: one block
    assert geo(fake, "dispatch", 100, 200) == (25, 256)  # 200 rows: 25 blocks
    assert geo(fake, "dispatch", 128, 1024) == (32, 256)  # 1024 rows: the bucket's 32
    assert geo(fake, "dispatch", 4096, 32768) == (132, 512)  # past 128 tokens: the whole GPU, 16 waves a block
    assert geo(fake, "dispatch", 4096, 160) == (10, 512)  # 160 rows / 16 waves: 10 blocks
    fake.config = _config(launch_blocks=500, launch_threads=256, launch_rows="wave", world_size=2)
    assert geo(fake, "combine", 1, 1) == (132, 256)  # capped at what stays resident: one block per SM here
    assert geo(fake, "dispatch", 4096, 32768) == (132, 256)
    occupancy.update(dispatch=3, combine=2)  # smaller blocks: more of them resident
    assert geo(fake, "combine", 1, 1) == (264, 256)
    assert geo(fake, "dispatch", 4096, 32768) == (396, 256)
    assert geo(fake, "dispatch", 16, 128) == (16, 256)  # never more blocks than waves of work


def test_native_block_rows_take_one_block_per_row():
    fake = types.SimpleNamespace(arch="sm_90", num_sms=132, wave=32, _dispatch_converts=False,
                                 config=_config(launch_blocks=264, launch_threads=256, launch_rows="block", world_size=2),
                                 k={"dispatch": types.SimpleNamespace(blocks_per_sm=lambda t: 8)})
    fake._block_rows = lambda tokens: NativeBackend._block_rows(fake, tokens)
    geo = NativeBackend._geometry
    assert NativeBackend._block_rows(fake, 128)
    assert geo(fake, "dispatch", 128, 256) == (256, 256)  # one block per (token, rank) row, at most the grid
    assert geo(fake, "dispatch", 4096, 8192) == (264, 256)
    fake.config.launch_rows = "wave"
    assert geo(fake, "dispatch", 128, 256) == (32, 256)  # eight waves per block: a row each
    fake.config.launch_rows, fake._dispatch_converts = "block", True
    assert not NativeBackend._block_rows(fake, 128)  # in-flight quantization copies by wave
    assert geo(fake, "dispatch", 128, 256) == (32, 256)
    fake.config.launch_rows, fake._dispatch_converts = "", False  # the table decides
    assert NativeBackend._block_rows(fake, 128) == (S.geometry(S.load(), "sm_90", "dispatch", 128).rows == "block")


def test_world_specific_buckets_and_the_fallback(spec_copy):
    _write(spec_copy, _table({("sm_90", "dispatch"): [
        "max_tokens = 128\nblocks = 32\nthreads = 256", "max_tokens = 0\nblocks = 0\nthreads = 512",
        "world = 8\nmax_tokens = 64\nblocks = 16\nthreads = 128", "world = 8\nmax_tokens = 0\nblocks = 0\nthreads = 1024"]}))
    specs = S.load(spec_copy)
    assert S.geometry(specs, "sm_90", "dispatch", 100, world=8) == S.Bucket(max_tokens=0, blocks=0, threads=1024, world=8)
    assert S.geometry(specs, "sm_90", "dispatch", 10, world=8).blocks == 16
    assert S.geometry(specs, "sm_90", "dispatch", 100, world=2).blocks == 32  # no world-2 buckets: the fallback
    assert S.geometry(specs, "sm_90", "dispatch", 100).blocks == 32
    assert [b.world for b in S.buckets_for(specs, "sm_90", "dispatch", 8)] == [8, 8]


def test_tuner_writes_its_world_size_and_keeps_the_fallback(spec_copy):
    path = spec_copy / "tuning.toml"
    before = S.load(spec_copy).tuning[("sm_90", "dispatch")]
    new = {"dispatch": tune.buckets_from({128: (16, 128), 4096: (0, 1024, "wave")}, world=8)}
    text = tune.rewrite(path, "sm_90", new)
    assert "world = 8" in text
    path.write_text(text)
    specs = S.load(spec_copy)
    assert S.buckets_for(specs, "sm_90", "dispatch", 0) == before  # the fallback is untouched
    assert S.geometry(specs, "sm_90", "dispatch", 4096, world=8).threads == 1024
    again = {"dispatch": tune.buckets_from({4096: (64, 512)}, world=8)}  # a second run replaces world 8 only
    path.write_text(tune.rewrite(path, "sm_90", again))
    specs = S.load(spec_copy)
    assert S.buckets_for(specs, "sm_90", "dispatch", 8) == (S.Bucket(max_tokens=0, blocks=64, threads=512, world=8),)
    assert S.buckets_for(specs, "sm_90", "dispatch", 0) == before


def test_native_geometry_uses_the_ops_world_size(spec_copy, monkeypatch):
    _write(spec_copy, _table({("sm_90", "dispatch"): [
        "max_tokens = 0\nblocks = 0\nthreads = 512", "world = 8\nmax_tokens = 0\nblocks = 0\nthreads = 128"]}))
    specs = S.load(spec_copy)
    import runtime.backends.native as native

    monkeypatch.setattr(native, "load_specs", lambda: specs)
    fake = types.SimpleNamespace(arch="sm_90", num_sms=132, wave=32, _dispatch_converts=False,
                                 config=_config(launch_blocks=0, launch_threads=0, launch_rows="",
                                                              world_size=8),
                                 k={"dispatch": types.SimpleNamespace(blocks_per_sm=lambda t: 4)})
    fake._block_rows = lambda tokens: NativeBackend._block_rows(fake, tokens)
    assert NativeBackend._geometry(fake, "dispatch", 4096, 8 * 4096)[1] == 128
    fake.config.world_size = 2
    assert NativeBackend._geometry(fake, "dispatch", 4096, 2 * 4096)[1] == 512


def test_ll_threshold_is_the_last_count_of_an_unbroken_low_latency_win():
    assert tune.ll_threshold({1: (9.0, 20.0), 8: (10.0, 21.0), 32: (14.0, 22.0), 128: (30.0, 29.0)}) == 32
    assert tune.ll_threshold({1: (9.0, 20.0), 8: (25.0, 21.0), 32: (14.0, 22.0)}) == 1  # a loss ends the run
    assert tune.ll_threshold({1: (21.0, 20.0), 8: (10.0, 21.0)}) == 0
    assert tune.ll_threshold({64: (5.0, 6.0), 1: (1.0, 2.0)}) == 64  # in token order, not insertion order


def test_tuner_writes_the_ll_threshold_of_one_target_only(spec_copy):
    path = spec_copy / "tuning.toml"
    before = S.load(spec_copy)
    path.write_text(tune.rewrite(path, "sm_90", {}, ll_max=32))
    after = S.load(spec_copy)
    assert after.ll_max_tokens["sm_90"] == 32
    assert {t: n for t, n in after.ll_max_tokens.items() if t != "sm_90"} == \
        {t: n for t, n in before.ll_max_tokens.items() if t != "sm_90"}
    assert after.tuning == before.tuning  # the buckets are kept as they were
