from trainer.startup.handoff import hand_over

# FT: a warm standby of this local rank (trainer/startup/standby.py), else a child of the node's fork server
# (trainer/startup/forkserver.py), runs the worker if one is there; this process is then its proxy
code = hand_over()
if code is not None:
    raise SystemExit(code)

from trainer.cli import main  # noqa: E402 - only when no standby or fork server took over (imports torch)

raise SystemExit(main())
