"""Parameter validation: every problem reported at once, each saying what to change."""

import pytest

from components.lib.params import DEFAULTS, ParamError, PipelineParams, parse_faults
from pipelines.demo import demo_params


def errors(**kw) -> str:
    return "\n".join(PipelineParams(**kw).errors())


IMAGE = "registry.example.com/team/resilient-train:0.1.0"


def test_defaults_and_demo_are_valid(tmp_path):
    PipelineParams(image=IMAGE).validate()  # pipelines.compile --image supplies the image's default
    assert "pipelines.compile --image" in "\n".join(DEFAULTS.errors())  # no placeholder image
    params = demo_params(tmp_path / "work")
    assert {f.kind for f in parse_faults(params["faults"])} == {"exception", "sigkill", "node_lost", "sigterm"}


def test_the_straggler_drill_passes_through_the_pipeline(tmp_path):
    params = demo_params(tmp_path / "work", faults="1:20:slow:0.5", trainer_overrides=["--resiliency.straggler=evict"])
    assert [str(f) for f in parse_faults(params["faults"])] == ["1:20:slow:0.5"]  # the trainer's item, unchanged
    assert "slow takes a factor in (0, 10]" in errors(faults="1:20:slow")
    assert "slow takes a factor" in errors(faults="1:20:exception:0.5")


def test_steps_must_exceed_checkpoint_interval():
    msg = errors(steps=40, checkpoint_interval=50)
    assert "steps (40) must be greater than checkpoint_interval (50)" in msg
    assert "lower checkpoint_interval or raise steps" in msg


@pytest.mark.parametrize("kw, expected", [
    ({"backend": "local", "nodes": 0, "workdir": "/tmp/w"}, "nodes must be"),
    ({"workdir": "/data/runs"}, "must be under /mnt/shared"),
    ({"workdir": "runs/x", "backend": "local"}, "workdir must be an absolute path"),
    ({"faults": "0:10:explode"}, "fault '0:10:explode' must look like rank:step:kind"),
    ({"faults": "0:999:sigkill"}, "fault 0:999:sigkill: step must be in 1..steps (400)"),
    ({"faults": "2:10:sigkill"}, "rank must be < the world size (2"),
    ({"faults": "0:10:exception", "inprocess_restart": False}, "set inprocess_restart=True"),
    ({"model": "13b"}, "model must be one of ['tiny', '1b', '8b']"),
    ({"replacement_pod_s": -1.0}, "replacement_pod_s must be a number of seconds >= 0"),
    ({"backend": "slurm"}, "backend must be one of"),
    ({"vocab_size": 100}, "vocab_size must be 257.."),
    ({"trainer_overrides": ["--train.run_dir=/x"]}, "sets a key the pipeline controls"),
    ({"trainer_overrides": ["lr=1"]}, "must look like '--section.key=value'"),
    ({"tolerations": [{"key": "a", "effects": "NoSchedule"}]}, "unknown key(s) ['effects']"),
    ({"init_from": "relative/dir"}, "init_from must be"),
    ({"steps": True}, "steps must be an integer"),
    ({"image": "registry.example.com/my image:1"}, "is not a valid image reference"),
    ({"image": "registry.example.com/team/img:1\n"}, "is not a valid image reference"),
    ({"image": "Registry/Team/Img"}, "is not a valid image reference"),
    ({"image": "img:bad tag"}, "is not a valid image reference"),
    ({"image_pull_secrets": ["Reg Cred"]}, "image_pull_secrets must be a list of Secret names"),
    ({"step_image_pull_secret": "Reg Cred"}, "step_image_pull_secret must be one Secret name"),
    ({"corpus": "https://example.com/c.txt"}, "data prep cannot read 'https' URIs"),
    ({"corpus": "ftp://example.com/c.txt"}, "file://, s3://, gs://, gcs://, hf://"),
    ({"corpus": "hf://meta-llama/Llama-3.1-8B"}, "hf://datasets/ORG/NAME[/PATH]"),
    ({"corpus": "hf://wikitext/wikitext-103"}, "a Hugging Face corpus is a dataset repo, hf://datasets/"),
    ({"tokenizer": "ftp://host/tokenizer.json"}, "tokenizer 'ftp://host/tokenizer.json': data prep cannot read"),
    ({"tokenizer": "tokenizers/llama"}, "tokenizer 'tokenizers/llama' must be an absolute path or a URI"),
    ({"tokenizer": "/mnt/shared/tok", "init_from": "promoted"}, "tokenizer must be empty with init_from"),
    ({"text_field": ""}, "text_field must name the JSON Lines key or Parquet column"),
    ({"text_field": " text"}, "no surrounding spaces"),
    ({"corpus_secret": ""}, "corpus_secret must name a Secret"),
    ({"corpus_secret": "creds.s3"}, "corpus_secret must name a Secret (a DNS-1123 label"),
    ({"corpus_secret": "train-shared"}, "corpus_secret and pvc_name must differ"),
    ({"base_model": "https://huggingface.co/meta-llama/Llama-3.2-1B"}, "downloads hf:// or s3:// URIs"),
    ({"base_model": "hf://datasets/HuggingFaceFW/fineweb"}, "must name a model repo, hf://ORG/NAME"),
    ({"base_model": "s3://"}, "must look like s3://BUCKET/PREFIX"),
    ({"base_model": "models/llama"}, "must be an absolute directory or an hf:// or s3:// URI"),
    ({"base_model": "/models/llama"}, "must be under /mnt/shared (the volume the training pods mount)"),
    ({"base_model": "hf://meta-llama/Llama-3.2-1B", "init_from": "promoted"}, "cannot both be set"),
    ({"trainer_overrides": ["--model.from_hf=/x"]}, "sets a key the pipeline controls"),
    ({"eval_memory": "32 GB"}, "eval_memory must be a Kubernetes quantity"),
    ({"eval_cpu": ""}, "eval_cpu must be a Kubernetes quantity"),
    ({"eval_gpus": -1}, "eval_gpus must be 0..16"),
    ({"launcher_node_selector": {"pool": 1}}, "launcher_node_selector must map label names to string values"),
])
def test_bad_parameter_names_the_fix(kw, expected):
    assert expected in errors(**kw)


def test_min_nodes_must_keep_the_global_batch_at_every_size():
    """Elastic: each size from min_nodes to nodes splits the global batch into whole micro-batches, or the run is
    refused before it starts, saying which min_nodes or global batch would (the trainer checks again at start)."""
    def elastic(**kw) -> str:
        return "\n".join(x for x in PipelineParams(**kw).errors() if "nodes" in x or "global_batch" in x)

    assert not elastic(nodes=2, min_nodes=1) and not elastic(nodes=4, min_nodes=4) and not elastic(nodes=4, min_nodes=0)
    assert not elastic(nodes=4, min_nodes=3, batch_size=2, trainer_overrides=["--train.global_batch=48"])
    assert ("min_nodes=2 cannot keep the global batch of 4 nodes on 3 nodes (it does not split into whole "
            "micro-batches there): set min_nodes=4, or a global batch every size from 2 to 4 nodes divides: "
            "'--train.global_batch=<a multiple of 48>' in trainer_overrides") in \
        errors(nodes=4, min_nodes=2, batch_size=2)
    assert "'--train.global_batch=<a multiple of batch_size x 24>'" in errors(nodes=4, min_nodes=3)  # the flavour's
    assert ("--train.global_batch=16 cannot be kept on 3 nodes of 2 rank(s) (min_nodes=2 to nodes=4): set "
            "min_nodes=4, or") in errors(nodes=4, min_nodes=2, batch_size=2,
                                         trainer_overrides=["--train.global_batch=16"])
    assert "min_nodes must be 0..2 (0 = not elastic); got 3" in errors(nodes=2, min_nodes=3)
    assert "must be a whole number of sequences" in errors(nodes=2, min_nodes=1,
                                                          trainer_overrides=["--train.global_batch=lots"])


def test_all_errors_are_reported_together():
    with pytest.raises(ParamError) as info:
        PipelineParams(steps=0, nodes=0, backend="nope").validate()
    assert len(info.value.errors) >= 3
    assert "steps must be 1..10000000; got 0" in str(info.value)


def test_unknown_parameter_lists_the_known_ones():
    with pytest.raises(ParamError, match="unknown parameter.*'stpes'.*'steps'"):
        PipelineParams.from_mapping({"stpes": 10})


@pytest.mark.parametrize("image", [
    "busybox", "registry.example.com/team/resilient-train:0.1.0", "localhost:5000/rt:dev",
    "nvcr.io/nvidia/pytorch:25.10-py3", "ghcr.io/a/b/c@sha256:" + "a" * 64, "rt:0.1.0+7aef037-dirty".replace("+", "_"),
])
def test_valid_image_references_pass(image):
    assert PipelineParams(image=image).errors() == []


@pytest.mark.parametrize("corpus", ["", "/mnt/shared/corpus", "file:///mnt/shared/corpus.txt", "relative/dir",
                                    "s3://team-data/corpus/", "gs://team-data/corpus", "gs://bucket/c/*.jsonl.gz",
                                    "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT"])
def test_corpus_that_data_prep_reads_passes(corpus):
    assert not [e for e in PipelineParams(image=IMAGE, corpus=corpus).errors() if "corpus" in e]


@pytest.mark.parametrize("kw", [
    {"base_model": "hf://meta-llama/Llama-3.2-1B"},
    {"base_model": "s3://models/llama-3.1-8b/", "tokenizer": "s3://models/llama-3.1-8b/tokenizer.json"},
    {"base_model": "/mnt/shared/models/llama-3.2-1b", "backend": "trainjob"},
    {"base_model": "/home/me/llama", "backend": "local", "workdir": "/tmp/w"},  # local: any directory it sees
    {"tokenizer": "hf://meta-llama/Llama-3.2-1B", "text_field": "content", "corpus_secret": "hf-and-s3"},
])
def test_bring_your_own_data_and_model_pass(kw):
    assert PipelineParams(image=IMAGE, **kw).errors() == []
