"""``data_prep``: corpus -> tokenizer -> token shards on shared storage; the manifest as a Dataset artifact."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components.lib.params import DEFAULT_IMAGE


@dsl.component(base_image=DEFAULT_IMAGE, packages_to_install=[], install_kfp_package=False)
def data_prep(corpus: str, vocab_size: int, max_corpus_bytes: int, workdir: str, run_id: str,
              dataset: Output[Dataset]):
    """Build ``<workdir>/<run_id>/data``; ``dataset`` holds manifest.json and metadata (tokens, checksums)."""
    import time

    from components.lib.data_step import prepare
    from components.lib.layout import RunLayout

    start = time.monotonic()
    meta = prepare(corpus, RunLayout(workdir, run_id), vocab_size=vocab_size, max_bytes=max_corpus_bytes,
                   artifact_dir=dataset.path)
    dataset.metadata.update(meta)
    print(f"[data] {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}, "
          f"{meta['num_shards']} shard(s) in {meta['data_dir']} ({time.monotonic() - start:.1f} s)")
