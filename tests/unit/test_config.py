import pytest

from trainer.config import ConfigError, JobConfig, describe, field_docs, load_config, parse_args, ModelConfig


def test_flavours_load_and_validate():
    for name in ("tiny", "1b", "8b"):
        cfg = load_config(name, ["--data.path=/data"])
        assert cfg.model.name == name
    assert load_config("8b", ["--data.path=/d"]).model.ffn_dim == 14336


def test_precedence_defaults_toml_cli(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nbatch_size = 3\n[data]\npath = "/x"\n')
    cfg = load_config(toml, ["--train.steps=9", "--optim.lr=0.5", "--train.compile=true",
                             "--resiliency.faults=1:5:exception,0:7:sigkill"])
    assert cfg.train.steps == 9  # CLI beats TOML
    assert cfg.train.batch_size == 3  # TOML beats default
    assert cfg.optim.lr == 0.5 and cfg.train.compile is True
    assert cfg.resiliency.faults == ["1:5:exception", "0:7:sigkill"]
    assert cfg.optim.beta2 == JobConfig().optim.beta2  # default kept


def test_cli_space_separated_override():
    _, cfg = parse_args(["--config", "tiny", "--data.path", "/d", "--train.steps", "3"])
    assert cfg.train.steps == 3 and cfg.data.path == "/d"


@pytest.mark.parametrize(
    "override, message",
    [
        ("--checkpoint.keep=1", "checkpoint.keep must be >= 2"),
        ("--model.n_heads=7", "model.dim (256) must be divisible by model.n_heads (7)"),
        ("--train.device=tpu", "train.device must be one of"),
        ("--train.steps=abc", "--train.steps='abc' is not a valid int"),
        ("--train.nope=1", "unknown key train.nope"),
        ("--bogus.key=1", "unknown config section 'bogus'"),
        ("--resiliency.hard_timeout_s=1", "must be greater than resiliency.soft_timeout_s"),
    ],
)
def test_validation_errors_say_what_to_change(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("tiny", ["--data.path=/d", override])


def test_missing_data_path_is_reported():
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config("tiny")


def test_wrong_type_in_toml(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="train.steps must be of type int"):
        load_config(toml, ["--data.path=/d"])


def test_unknown_flavour_lists_shipped_ones():
    with pytest.raises(ConfigError, match=r"flavours: \['1b', '8b', 'tiny'\]"):
        load_config("70b")


def test_every_field_is_documented():
    import dataclasses
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{section.name}] fields without a docstring: {missing}"
    assert "Peak learning rate" in describe()


def test_config_round_trips_through_json():
    cfg = load_config("tiny", ["--data.path=/d", "--train.steps=5"])
    import json
    again = JobConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg


def test_accumulation_follows_the_world_size_and_refuses_what_it_cannot_keep():
    """``train.global_batch``: the micro-batches each rank accumulates on each world size; a world size that cannot
    split it, or one rank under ``single_rank=direct`` (which finishes the gradients at every backward), refused."""
    from trainer.config import TrainConfig, accumulation

    cfg = TrainConfig(batch_size=2, global_batch=8)
    assert [accumulation(cfg, w) for w in (1, 2, 4)] == [4, 2, 1]
    assert accumulation(TrainConfig(batch_size=2), 3) == 1  # 0: batch size x world size
    with pytest.raises(ConfigError, match=r"global_batch=8 is not a multiple of train.batch_size x world size = 2 x 3"):
        accumulation(cfg, 3)
    with pytest.raises(ConfigError, match="single_rank=direct cannot accumulate"):
        accumulation(TrainConfig(batch_size=2, global_batch=8, single_rank="direct"), 1)
    assert accumulation(TrainConfig(batch_size=2, global_batch=8, single_rank="direct"), 4) == 1


def test_a_node_range_keeps_one_global_batch_or_says_which_would():
    """``TRAINER_NODE_RANGE=MIN:MAX`` (elastic): an unset global batch becomes the full size's; one that some size of
    the range cannot split is refused naming a global batch every size can and the fewest nodes that keep it."""
    from trainer.config import TrainConfig, keep_global_batch

    cfg = TrainConfig(batch_size=2)
    note = keep_global_batch(cfg, "1:2", 2)
    assert note == "train.global_batch=8 (the batch of 2 nodes), kept on any of 1 to 2 nodes"
    assert cfg.global_batch == 8
    assert keep_global_batch(TrainConfig(batch_size=2), "2:2", 4) is None  # one size: nothing to keep
    kept = TrainConfig(batch_size=2, global_batch=48)
    assert keep_global_batch(kept, "2:4", 2) is None and kept.global_batch == 48  # 48 = 4 x 12: every size splits it
    with pytest.raises(ConfigError, match=r"train.global_batch=16 cannot be kept on 3 node\(s\) of the job's range 2:4 "
                                          r"\(2 rank\(s\) a node x train.batch_size=2\): set a global batch every size "
                                          r"divides, a multiple of 48 \(e.g. 48\), or at least 4 as the fewest nodes"):
        keep_global_batch(TrainConfig(batch_size=2), "2:4", 2)
    with pytest.raises(ConfigError, match=r"global_batch=9 cannot be kept on 4 node\(s\).* of 12 \(e.g. 12\)$"):
        keep_global_batch(TrainConfig(batch_size=1, global_batch=9), "3:4", 1)
    with pytest.raises(ConfigError, match="single_rank=direct cannot accumulate"):  # one rank at the range's low end
        keep_global_batch(TrainConfig(batch_size=2, single_rank="direct"), "1:2", 1)
    for bad in ("2", "x:3", "3:2", "0:2"):
        with pytest.raises(ConfigError, match="TRAINER_NODE_RANGE must be MIN:MAX"):
            keep_global_batch(TrainConfig(), bad if bad != "2" else "2:1", 1)
