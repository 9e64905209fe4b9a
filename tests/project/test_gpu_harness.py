"""The GPU tests' collective helpers (tests/gpu/dist_util.py), run on CPU ranks over gloo: a failure on
one rank must fail every rank at the same point, never leave the others waiting in a collective."""

from tests.support.ep_dist import get_world


def _run(rank, world_size, failing_rank, kind):
    from tests.gpu.dist_util import run_collective

    def check():
        if rank == failing_rank:
            if kind == "assert":
                assert False, "3 rows differ"
            raise RuntimeError("EP kernel timed out")
        return None
    try:
        run_collective(check)
    except AssertionError as e:
        return str(e)
    return "passed"


def test_an_error_on_one_rank_fails_every_rank():
    """An error that is not an assertion (EpTimeoutError, a CUDA error) is reported by every rank: before,
    the failing rank left the test alone and its peers waited in the next collective."""
    got = get_world(2).run(_run, 1, "error")
    assert got == ["rank 1: RuntimeError: EP kernel timed out"] * 2


def test_an_assertion_on_one_rank_fails_every_rank():
    got = get_world(2).run(_run, 0, "assert")
    assert got == ["rank 0: 3 rows differ"] * 2


def test_no_failure_passes_everywhere():
    assert get_world(2).run(_run, -1, "error") == ["passed", "passed"]
