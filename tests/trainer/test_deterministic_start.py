"""The trainer's start: deterministic algorithms on, without paying for what the run does not use."""

from __future__ import annotations


def test_deterministic_algorithms_without_compile_do_not_import_inductor():
    """A CPU run's start sets the deterministic flag without importing Inductor's config (0.5 s of CPU per process);
    with compile it goes through torch's own function, which also sets Inductor's flag."""
    import subprocess
    import sys

    probe = ("import sys, torch; from trainer.train import deterministic_algorithms as d; d(compiled={}); "
             "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), "
             "'torch._inductor.config' in sys.modules)")
    for compiled, inductor in ((False, False), (True, True)):
        out = subprocess.run([sys.executable, "-c", probe.format(compiled)], capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["True", "True", str(inductor)], out.stdout + out.stderr
