"""The CPU allocator settings: what model-serving processes start with, and that they take effect."""

import os
import subprocess
import sys
import textwrap

import pytest

from serve_app.engine import allocator


def test_env_leaves_the_users_variables_and_turns_off(monkeypatch):
    for name in allocator.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SPECSERVE_KEEP_FREED_MEMORY", raising=False)
    assert allocator.allocator_env() == allocator.ALLOCATOR_ENV
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert "MALLOC_ARENA_MAX" not in allocator.allocator_env() and len(allocator.allocator_env()) == 3
    monkeypatch.setenv("SPECSERVE_KEEP_FREED_MEMORY", "0")
    assert allocator.allocator_env() == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("how", ["environment", "mallopt"])
def test_freed_blocks_are_reused_not_faulted_in_again(how):
    """An 82 MB block (a step's logits at a 128k vocabulary) allocated, filled and freed 20 times: with the
    settings the pages stay mapped once the heap has grown (a few rounds), so the last 8 rounds take
    almost no page faults; glibc's defaults unmap the block at every free and fault its 20k pages back
    in each time. `environment`: in a thread of a process started with the variables (a model actor);
    `mallopt`: in the main thread of a process that set them while running (`specserve generate`)."""
    script = textwrap.dedent("""
        import resource, sys, threading, torch
        from serve_app.engine.allocator import keep_freed_memory
        if sys.argv[1] == "mallopt":
            assert keep_freed_memory()
        faults = []
        def work():
            for _ in range(20):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                torch.empty(82 << 18).fill_(1.0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if sys.argv[1] == "environment":
            t = threading.Thread(target=work); t.start(); t.join()
        else:
            work()
        print(sum(faults[12:]))
    """)
    plain = {k: v for k, v in os.environ.items() if k not in allocator.ALLOCATOR_ENV}

    def faults(mode, env):
        return int(subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True,
                                  check=True).stdout.split()[-1])

    on = faults(how, {**plain, **allocator.ALLOCATOR_ENV} if how == "environment" else plain)
    off = faults("none", plain)
    assert off > 8 * 20000 and on < 8 * 20000 * 0.1, (on, off)
