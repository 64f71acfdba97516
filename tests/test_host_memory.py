"""``cpu.keep_memory``: XLA:CPU's per-call temporaries reuse pages instead of faulting in."""

import mmap
import os
import statistics
import subprocess
import sys
import textwrap

import pytest

from xlafit.platform.cpu import keep_freed_memory, page_faults, page_faults_since, peak_rss_bytes

# A program with a 64 MB temporary (the product, read by two reductions), called 24 times
# after a warm-up; prints the minor page faults of each call. 64 MB of fresh pages is
# 16,384 faults. The setting is per process and
# must come before JAX starts, so each case is its own process.
PROBE = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    import xlafit
    from xlafit.platform.cpu import CpuConfig
    from xlafit.platform.cpu import page_faults, page_faults_since
    xlafit.connect(1, cpu=CpuConfig(keep_memory=sys.argv[1] == "keep"))
    x, w = jnp.ones((2048, 64)), jnp.ones((64, 8192))  # a 64 MB product of few FLOPs
    f = jax.jit(lambda x, w: (lambda y: (y.sum(), y.max()))(x @ w))
    assert f.lower(x, w).compile().memory_analysis().temp_size_in_bytes >= 64 * 2**20
    jax.block_until_ready(f(x, w))
    for _ in range(24):
        before = page_faults()
        jax.block_until_ready(f(x, w))
        print(page_faults_since(before))
    """
)


def _median_faults(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return statistics.median(int(n) for n in out.stdout.split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_instead_of_faulted_in_again():
    # Without: every call faults its temporary in (16,384 with 4 kB pages; a kernel that backs
    # the block with 2 MB pages faults 512 times fewer, hence the bound). With: none, except
    # while the heap grows to its working size, by a temporary per call: on an idle machine
    # the first call, with two other JAX processes busy up to four of 16 (measured), so
    # the test compares medians rather than totals.
    off, keep = _median_faults("off"), _median_faults("keep")
    assert off >= 32, off  # at least one fault per 2 MB of the temporary
    assert keep * 4 < off, (keep, off)


def test_the_users_glibc_tunables_win(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=65536")
    assert keep_freed_memory() is False


@pytest.mark.skipif(sys.platform == "win32", reason="no getrusage")
def test_page_faults_and_peak_memory_count_fresh_pages():
    # What the bench reports per timed step: a fresh anonymous mapping faults in on first
    # write, one fault per page (at least one per 2 MB where the kernel uses huge pages).
    size = 64 * 2**20
    before = page_faults()
    block = mmap.mmap(-1, size)
    for offset in range(0, size, 4096):
        block[offset] = 1
    assert page_faults_since(before) >= size // 2**21
    assert page_faults_since(None) is None
    assert peak_rss_bytes() >= size
    block.close()


def test_inline_dispatch_returns_each_call_done():
    """``cpu.async_dispatch=false`` (the ResNet recipe's): a one-device CPU call returns
    when it is done, its temporaries freed, so calls never overlap and the heap keeps one copy."""
    probe = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp
        import xlafit
        from xlafit.platform.cpu import CpuConfig
        xlafit.connect(1, cpu=CpuConfig(async_dispatch=sys.argv[1] == "async"))
        x, w = jnp.ones((2048, 64)), jnp.ones((64, 8192))  # a 64 MB product of few FLOPs
        f = jax.jit(lambda x, w: (x @ w).sum())
        jax.block_until_ready(f(x, w))
        outs = [f(x, w) for _ in range(8)]
        print(outs[0].is_ready())
        """
    )
    ready = {
        mode: subprocess.run(
            [sys.executable, "-c", probe, mode], capture_output=True, text=True, timeout=120, check=True
        ).stdout.split()[-1]
        for mode in ("inline", "async")
    }
    assert ready == {"inline": "True", "async": "False"}, ready
    from xlafit.recipes import load_config

    assert load_config("resnet").cpu.async_dispatch is False
    assert load_config("mnist").cpu.async_dispatch is True


# 200 MB of 4 KiB blocks in glibc's heap (each under its mmap threshold), freed below a block
# still in use, so that free() alone cannot shrink the heap; prints whether the release ran and
# the resident memory before and after it.
TRIM = textwrap.dedent(
    """
    import sys
    from xlafit.platform.cpu import keep_freed_memory, release_freed_memory
    def rss():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
    if sys.argv[1] == "keep":
        keep_freed_memory()
    blocks = [bytes(4096) for _ in range(50_000)]
    fence = bytes(4096)
    del blocks
    held = rss()
    print(release_freed_memory(), held, rss())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_memory_goes_back_to_the_system_unless_the_process_keeps_it():
    """What a TPU compile frees is handed back before the next one (``check --tpu``), unless
    the process keeps freed memory for reuse (``cpu.keep_memory``)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def run(mode):
        out = subprocess.run([sys.executable, "-c", TRIM, mode], capture_output=True, text=True, env=env, check=True)
        ran, held, after = out.stdout.split()
        return ran == "True", int(held), int(after)

    ran, held, after = run("trim")
    assert ran and held - after > 150 * 2**20, (held, after)
    ran, held, after = run("keep")
    assert not ran and held - after < 10 * 2**20, (held, after)
