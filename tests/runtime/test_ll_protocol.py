"""The low-latency intranode protocol on CPU: wire format sizes, epochs, per-call selection, the config and
spec surface, and a model of the protocol (tests/support/ll_model.py) run under random interleavings: rows arrive
complete and in (source rank, token) order, nothing is overwritten before it is consumed, and the two
assumptions it rests on (untorn 16-byte vectors, consumed vectors zeroed) are each shown to be needed."""

import random

import pytest
import torch

from generator import specs as S
from generator.abi import LL_MAX_TOKENS
from generator.toolchain import has_mnemonic
from runtime import ll
from runtime.config import EpDispatchCombineConfig, load_specs
from runtime.errors import ConfigError
from tests.support import ll_model as M

BASE = dict(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
            num_experts_per_token=2, kernel_backend="torch")


# --- wire format -------------------------------------------------------------------------------------
def test_row_and_cell_sizes():
    # bf16, hidden 7168, top-8: 3584 payload words + 8 ids + 8 weights + the source token = 3601 words
    assert ll.row_layout(14336, 0, 8) == {"payload": 0, "scales": 3584, "ids": 3584, "weights": 3592, "src": 3600,
                                          "words": 3601}
    assert ll.row_bytes(14336, 0, 8) == 16 * 1201  # 1.34x the row: 12 data bytes per 16
    # fp8 payload with 56 fp32 scales; e8m0 scales of an odd byte count pad their last word
    assert ll.row_bytes(7168, 224, 8) == 16 * ll.vectors(1792 + 56 + 17)
    assert ll.row_layout(64, 3, 1)["ids"] == 16 + 1
    assert ll.cell_bytes(14336, 8) == 16 * ll.vectors(3584 + 8)
    assert ll.regions(2, 0, 100, 100) == []
    assert dict(ll.regions(2, 4, 32, 48)) == {"ll_cnt": 32, "ll_x": 2 * 2 * 4 * 32, "ll_c": 4 * 2 * 48,
                                              "ll_map": 4 * (8 + 2)}


def test_model_message_matches_the_layout():
    words = M.message_words([1, 2, 3, 4], b"\x05\x06\x07", [9, -1], [0.5, 1.0], t=7)
    lay = ll.row_layout(16, 3, 2)
    assert words[lay["scales"]] == 0x070605 and words[lay["ids"] + 1] == 0xFFFFFFFF
    assert words[lay["weights"]] == M.f32_bits(0.5) and words[lay["src"]] == 7
    vecs = M.vectors_of(words, epoch=5)
    assert len(vecs) == ll.vectors(len(words)) and all(v[3] == 5 for v in vecs)


def test_epochs_never_zero_and_wrap():
    assert ll.epoch(0) == 1 and ll.epoch(41) == 42
    assert ll.epoch(2 ** 32 - 2) == 2 ** 32 - 1
    assert ll.epoch(2 ** 32 - 1) == 1 and ll.epoch(2 ** 32) == 1  # zero skipped: two calls share 1 at the wrap...
    assert (2 ** 32 - 1) & 1 != (2 ** 32) & 1  # ...on different parities (buffers and count words)


# --- selection -----------------------------------------------------------------------------------------
def test_resolve_by_the_config_bound_only():
    # auto: the config's token bound against the target's threshold; never a call's count (there is none here)
    assert ll.resolve("auto", True, 8, 8) == "ll" and ll.resolve("auto", True, 1, 8) == "ll"
    assert ll.resolve("auto", True, 9, 8) == "bw" and ll.resolve("auto", True, 4096, 128) == "bw"
    assert ll.resolve("auto", False, 1, 128) == "bw"  # the config cannot run ll
    assert ll.resolve("auto", True, 1, 0) == "bw"  # threshold 0: never
    assert ll.resolve("ll", True, 512, 8) == "ll" and ll.resolve("bw", True, 1, 128) == "bw"
    assert ll.buffer_tokens("ll", 512) == 512 and ll.buffer_tokens("bw", 4096) == 0


def _scn_resolve(rank, world, bound, thresholds):
    """What each rank's op would take: every rank passes its own (different) call sizes, none of which enters."""
    from runtime import ll as L
    return L.resolve("auto", True, bound, thresholds[rank])


@pytest.mark.parametrize("bound", [1, 8, 64, 4096])
def test_every_rank_resolves_alike_whatever_its_token_counts(bound):
    """The decision function across ranks: ranks whose calls carry different token counts (rank r: r + 1 tokens,
    up to the bound) still decide alike, since only the shared config bound and the target's threshold enter;
    a rank whose target threshold differs is what the native backend's cross-rank check catches."""
    from tests.support.ep_dist import get_world

    got = get_world(2).run(_scn_resolve, bound, [8, 8])
    assert got[0] == got[1] == ("ll" if bound <= 8 else "bw")
    split = get_world(2).run(_scn_resolve, 8, [8, 4])
    assert split == ["ll", "bw"]  # hence check_same_protocol (runtime/backends/native.py)


def test_tuning_threshold_per_target():
    specs = load_specs()
    assert specs.ll_max_tokens["sm_90"] > 0 and set(specs.ll_max_tokens) == set(specs.targets)
    for t in specs.targets:
        for role in ("dispatch_ll", "combine_ll"):
            assert S.geometry(specs, t, role, 1).threads % specs.targets[t].wave_size == 0


@pytest.mark.parametrize("value", ["-1", str(LL_MAX_TOKENS + 1), '"64"'])
def test_tuning_threshold_checked(tmp_path, value):
    import shutil

    root = tmp_path / "specs"
    shutil.copytree(S.default_root(), root)
    p = root / "tuning.toml"
    p.write_text(p.read_text().replace("intranode_ll_max_tokens = 8 ", f"intranode_ll_max_tokens = {value} "))
    with pytest.raises(S.SpecError, match=r"tuning.toml:\d+: \[tuning.sm_90\] intranode_ll_max_tokens"):
        S.load(root)


def test_tuner_rewrite_keeps_the_thresholds(tmp_path):
    import shutil

    from bench import tune

    root = tmp_path / "specs"
    shutil.copytree(S.default_root(), root)
    new = {"dispatch_ll": [S.Bucket(max_tokens=0, blocks=0, threads=128)]}
    (root / "tuning.toml").write_text(tune.rewrite(root / "tuning.toml", "sm_90", new))
    specs = S.load(root)
    assert specs.ll_max_tokens == load_specs().ll_max_tokens
    assert S.geometry(specs, "sm_90", "dispatch_ll", 1).threads == 128


def test_config_protocol_field():
    c = EpDispatchCombineConfig(**BASE)
    assert c.intranode_protocol == "auto" and c.intranode_protocols == ("ll", "bw")  # the default: decided per op
    assert EpDispatchCombineConfig(**BASE, intranode_protocol="auto").intranode_protocols == ("ll", "bw")
    assert EpDispatchCombineConfig(**BASE, intranode_protocol="ll").intranode_protocols == ("ll",)
    with pytest.raises(ConfigError, match=r"^intranode_protocol='fast': must be one of 'auto', 'll', 'bw'$"):
        EpDispatchCombineConfig(**BASE, intranode_protocol="fast")
    # auto falls back to bw where ll cannot run; "ll" says why
    q = EpDispatchCombineConfig(**BASE, quant_type="fp8_blockwise", intranode_protocol="auto")
    assert q.intranode_protocols == ("bw",)
    with pytest.raises(ConfigError, match=r"^ll_verbatim: the low-latency intranode protocol"):
        EpDispatchCombineConfig(**BASE, quant_type="fp8_blockwise", combine_mode="scatter", intranode_protocol="ll")
    with pytest.raises(ConfigError, match=r"^ll_verbatim: "):
        EpDispatchCombineConfig(**BASE, dispatch_quant_type="fp8_blockwise", intranode_protocol="ll")
    with pytest.raises(ConfigError, match=r"^intranode_protocol='ll': .*combine_mode='scatter'"):
        EpDispatchCombineConfig(**BASE, combine_mode="scatter", intranode_protocol="ll")
    with pytest.raises(ConfigError, match=rf"^intranode_protocol='ll': .*at most {LL_MAX_TOKENS} tokens per rank"):
        EpDispatchCombineConfig(**dict(BASE, max_num_inp_token_per_rank=LL_MAX_TOKENS + 1), intranode_protocol="ll")
    with pytest.raises(ConfigError, match=r"^intranode_protocol='ll': .*intranode only"):
        EpDispatchCombineConfig(**dict(BASE, world_size=4), gpu_per_node=2, intranode_protocol="ll")
    assert EpDispatchCombineConfig(**dict(BASE, world_size=4), gpu_per_node=2,
                                   intranode_protocol="auto").intranode_protocols == ()
    # pre-quantized payloads move verbatim: fine
    fp8 = EpDispatchCombineConfig(**BASE, dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16,
                                  scale_dim=2, scale_type_size=4, intranode_protocol="ll")
    assert fp8.intranode_protocols == ("ll",)


def test_plan_names_and_layout():
    from runtime.plan import Plan
    from runtime.op import native_workspace

    t = load_specs().targets["sm_90"]
    cfg = EpDispatchCombineConfig(**BASE)
    plan = Plan.of(cfg, t)
    assert plan.ll_variants == ("dispatch_ll.bf16.intranode", "combine_ll.bf16.intranode")
    lay = plan.layout(cfg, ll_tokens=8)
    assert lay["counter"] < lay["ll_cnt"] < lay["ll_x"] < lay["ll_c"] < lay["ll_map"] < lay["recv_x"]  # reset zeroes them
    assert lay["ll_c"] - lay["ll_x"] >= 2 * 2 * 8 * plan.ll_row and "ll_x" not in plan.layout(cfg, ll_tokens=0)
    nat = native_workspace(cfg, ll_tokens=8)
    assert nat["total_bytes"] == lay["total"]
    fp8 = EpDispatchCombineConfig(**BASE, dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16,
                                  scale_dim=2, scale_type_size=4)
    assert Plan.of(fp8, t).ll_variants[0] == "dispatch_ll.fp8_e4m3fn.intranode"


def test_isa_expectation_with_trailing_operands():
    ops = {"flat_store_dwordx4 v[6:7], v[2:5] sc0 sc1", "flat_load_dwordx4 v[2:5], v[6:7]",
           "flat_store_b128 v0, v[2:5], s[4:5] scale_offset scope:SCOPE_SYS"}
    assert has_mnemonic(ops, "flat_store_dwordx4 ... sc0 sc1")
    assert not has_mnemonic(ops, "flat_load_dwordx4 ... sc0 sc1")  # no scope bits: not system scope
    assert has_mnemonic(ops, "flat_store_b128 ... scope:SCOPE_SYS")


# --- the protocol model --------------------------------------------------------------------------------
def _scenario(seed, world=2, tokens=(3, 2, 4), calls="dcddc", torn=False, zeroing=True, start=0, cap=None,
              nwords=7):
    """Run `calls` (d: dispatch, c: combine) on every rank of a model fabric; check every result. Returns
    (problems, fabric)."""
    rng = random.Random(seed)
    fab = M.Fabric(world, rng, torn)
    ranks = [M.Rank(r) for r in range(world)]
    for r in ranks:
        r.ll_dispatches = r.ll_combines = start
    problems = []
    inputs = {}  # (call, rank) -> (dests, messages)
    for ci, kind in enumerate(calls):
        if kind == "d":
            for r in range(world):
                T = tokens[(ci + r) % len(tokens)]
                dests = [set(rng.sample(range(world), rng.randint(0, world))) for _ in range(T)]
                msgs = [[rng.randrange(1 << 20) for _ in range(nwords - 1)] + [t] for t in range(T)]
                inputs[(ci, r)] = (dests, msgs)
    last_d = {}

    def dispatch(ci, me):
        dests, msgs = inputs[(ci, me.rank)]
        yield from M.dispatch_call(fab, me, dests, msgs, nwords, cap or 10 ** 9, zeroing)
        want = [(s, t, inputs[(ci, s)][1][t]) for s in range(world) for t, ds in enumerate(inputs[(ci, s)][0])
                if me.rank in ds]
        kept = want[:cap] if cap else want
        if me.recv != kept:
            problems.append(f"call {ci} rank {me.rank}: received {me.recv} != {kept}")
        if me.dropped != len(want) - len(kept):
            problems.append(f"call {ci} rank {me.rank}: dropped {me.dropped}")

    def combine(di, me):
        expert = {(s, t): words for s, t, words in me.recv}  # identity expert
        dests, msgs = inputs[(di, me.rank)]
        yield from M.combine_call(fab, me, expert, nwords, dests, zeroing)
        for t, ds in enumerate(dests):
            kept_by = sum(1 for d in ds if (me.rank, t) in received_by[d][di])
            want = [kept_by * w for w in msgs[t]]
            if me.combined[t] != want:
                problems.append(f"combine after call {di} rank {me.rank} token {t}: {me.combined[t]} != {want}")

    received_by = {r: {} for r in range(world)}

    def record(ci, me):  # what this rank kept (for the combine's expectation), after its dispatch
        received_by[me.rank][ci] = {(s, t) for s, t, _ in me.recv}
        return
        yield

    plans = []
    for r in ranks:
        gens = []
        for ci, kind in enumerate(calls):
            if kind == "d":
                last_d[r.rank] = ci
                gens += [dispatch(ci, r), record(ci, r)]
            else:
                gens.append(combine(last_d[r.rank], r))
        plans.append(gens)
    try:
        M.run(fab, plans)
    except TimeoutError as e:  # a wrong source token sends a combine cell where nobody waits
        problems.append(str(e))
    return problems, fab


@pytest.mark.parametrize("seed", range(40))
def test_model_rows_arrive_whole_in_order_and_combine(seed):
    world = 2 + seed % 3
    problems, fab = _scenario(seed, world=world, cap=(5 if seed % 4 == 3 else None))
    assert not problems, problems[:3]
    assert fab.overwrites == 0  # no store ever landed on a vector its reader had not consumed


def test_model_wraps_the_epoch():
    for seed in range(10):
        problems, fab = _scenario(seed, start=2 ** 32 - 3, calls="dcdcdcdd")
        assert not problems and fab.overwrites == 0, problems[:3]


def test_model_torn_vectors_would_break_it():
    """If a 16-byte store could land as two halves, a reader could take a flag with stale data."""
    bad = sum(bool(_scenario(seed, torn=True)[0]) for seed in range(40))
    assert bad > 0


def _wrapped_rerun_wrong(seed: int, zeroing: bool) -> bool:
    """One dispatch, then the call counters jump 2^32 - 1 ahead (the next call has the first one's epoch and
    parity) and the same slots get other rows: does rank 0 receive anything but the new rows?"""
    rng = random.Random(seed)
    fab = M.Fabric(2, rng)
    ranks = [M.Rank(0), M.Rank(1)]
    dests = [{0, 1}, {1}, {0}]

    def rows():
        return {r: [[rng.randrange(1 << 20) for _ in range(6)] + [t] for t in range(3)] for r in range(2)}

    M.run(fab, [[M.dispatch_call(fab, ranks[r], dests, first[r], 7, 99, zeroing)] for r in range(2)]
          if (first := rows()) else [])
    for r in ranks:
        r.ll_dispatches += 2 ** 32 - 1
    new = rows()
    M.run(fab, [[M.dispatch_call(fab, ranks[r], dests, new[r], 7, 99, zeroing)] for r in range(2)])
    return [w for _, _, w in ranks[0].recv] != [new[s][t] for s in range(2) for t in range(3) if 0 in dests[t]]


def test_model_without_zeroing_a_wrapped_epoch_reads_stale_rows():
    """2^32 calls later a slot's old vectors carry the current epoch again: zeroing what was read is what
    keeps a reader from taking them."""
    assert any(_wrapped_rerun_wrong(seed, zeroing=False) for seed in range(30))
    assert not any(_wrapped_rerun_wrong(seed, zeroing=True) for seed in range(30))
