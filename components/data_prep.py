"""``data_prep``: corpus -> tokenizer -> token shards on shared storage; the manifest as a Dataset artifact."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def data_prep(corpus: str, vocab_size: int, max_corpus_bytes: int, workdir: str, run_id: str, init_from: str,
              model: str, promoted_registry: str, dataset: Output[Dataset], tokenizer: str = "",
              text_field: str = "text"):
    """Build ``<workdir>/<run_id>/data``; ``dataset`` holds manifest.json and metadata (tokens, checksums).

    ``corpus`` is a local path or an s3:// / gs:// / hf://datasets/ URI (credentials from the step's env);
    ``tokenizer`` a pretrained tokenizer.json or model directory (path or URI; empty: train our own BPE);
    ``text_field`` the JSONL key / Parquet column of the text. A warm start (``init_from``) reuses the tokenizer
    of the data its checkpoint was trained on.
    """
    import time

    from components.lib.data_step import prepare, warm_start_data_dir
    from components.lib.layout import RunLayout
    from components.lib.params import registry_location

    start = time.monotonic()
    tokenizer_from = warm_start_data_dir(init_from, registry_location(promoted_registry, workdir, model))
    if tokenizer_from:
        print(f"[data] warm start: reusing the tokenizer of {tokenizer_from}")
    meta = prepare(corpus, RunLayout(workdir, run_id), vocab_size=vocab_size, max_bytes=max_corpus_bytes,
                   artifact_dir=dataset.path, tokenizer_from=tokenizer_from, tokenizer=tokenizer,
                   text_field=text_field)
    dataset.metadata.update(meta)
    print(f"[data] {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}, "
          f"{meta['num_shards']} shard(s) in {meta['data_dir']} ({time.monotonic() - start:.1f} s)")
