"""``cleanup``: the exit handler; removes the run's training job or local processes, whatever happened."""

from kfp import dsl

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def cleanup(backend: str, workdir: str, namespace: str, run_id: str, status: dsl.PipelineTaskFinalStatus) -> str:
    """Delete the PyTorchJob or TrainJob (cluster backends) or kill leftover processes (local); idempotent."""
    from components.lib.layout import RunLayout
    from components.lib.params import PipelineParams
    from components.lib.train_step import backend_for, configure_step_logging

    configure_step_logging()
    p = PipelineParams(backend=backend, workdir=workdir, namespace=namespace)
    message = backend_for(backend).cleanup(p, RunLayout(workdir, run_id))
    print(f"[cleanup] pipeline {status.state}: {message}")
    return message
