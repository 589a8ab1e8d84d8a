"""``python -m bench.families minilm --objective mlm``: the same seed gives the same family
(review of issue 14's masked-LM family)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import families as bench_families

pytest.importorskip("transformers")


def _tiny_bert(root: Path) -> Path:
    """A small BertModel folder (config.json + model.safetensors), as MiniLM's is laid out."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    BertModel(cfg).save_pretrained(root)
    return root


def test_fresh_mlm_head_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    """The base's head starts from a fresh BertForMaskedLM head: unseeded, two runs of
    ``python -m bench.families minilm --seed 0`` trained different heads from different starts."""
    src = _tiny_bert(tmp_path / "bert")
    key = "cls.predictions.transform.dense.weight"
    a = bench_families.mlm_model(src, seed=7).state_dict()[key]
    b = bench_families.mlm_model(src, seed=7).state_dict()[key]
    c = bench_families.mlm_model(src, seed=8).state_dict()[key]
    assert bool((a == b).all())
    assert not bool((a == c).all())
    # the encoder is the source's, bit for bit; the decoder is tied to the word embeddings
    from safetensors.numpy import load_file

    enc = load_file(str(src / "model.safetensors"))
    m = bench_families.mlm_model(src, seed=7)
    got = m.state_dict()
    for name, w in enc.items():
        if not name.startswith("pooler.") and name != "embeddings.position_ids":
            assert (got[f"bert.{name}"].numpy() == w).all(), name
    assert m.cls.predictions.decoder.weight.data_ptr() == \
        m.bert.embeddings.word_embeddings.weight.data_ptr()
