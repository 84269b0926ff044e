"""``data_prep``: corpus -> tokenizer -> token shards on shared storage; the manifest as a Dataset artifact."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def data_prep(corpus: str, vocab_size: int, max_corpus_bytes: int, workdir: str, run_id: str, init_from: str,
              model: str, promoted_registry: str, dataset: Output[Dataset], tokenizer: str = "",
              text_field: str = "text", base_model: str = ""):
    """Build ``<workdir>/<run_id>/data``; ``dataset`` holds manifest.json and metadata (tokens, checksums).

    ``corpus`` is a local path or an s3:// / gs:// / hf://datasets/ URI; ``text_field`` the JSONL key / Parquet
    column of the text. The tokenizer: a warm start (``init_from``) reuses the one of the data its checkpoint was
    trained on; else ``tokenizer``, else ``base_model``'s; else data prep trains a byte-level BPE of ``vocab_size``. Credentials
    for s3://, gs:// and hf:// come from the ``corpus_secret`` Secret the pipeline mounts (names of the keys found
    are printed, never values), or from the environment when run locally.
    """
    import time

    from components.lib.credentials import MOUNT_DIR, load_mounted
    from components.lib.data_step import prepare, warm_start_data_dir
    from components.lib.layout import RunLayout
    from components.lib.params import registry_location
    from components.lib.storage import redact_uri

    start = time.monotonic()
    found = load_mounted(MOUNT_DIR)
    if found:
        print(f"[data] credentials from the mounted Secret: {', '.join(found)}")
    tokenizer_from = warm_start_data_dir(init_from, registry_location(promoted_registry, workdir, model))
    if tokenizer_from:
        print(f"[data] warm start: reusing the tokenizer of {tokenizer_from}")
    elif tokenizer or base_model:
        print(f"[data] tokenizer of {redact_uri(tokenizer or base_model)}")
    meta = prepare(corpus, RunLayout(workdir, run_id), vocab_size=vocab_size, max_bytes=max_corpus_bytes,
                   artifact_dir=dataset.path, tokenizer_from=tokenizer_from, tokenizer=tokenizer or base_model,
                   text_field=text_field)
    dataset.metadata.update(meta)
    print(f"[data] {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}, "
          f"{meta['num_shards']} shard(s) in {meta['data_dir']} ({time.monotonic() - start:.1f} s)")
