"""The WordNet gloss reader: parsing on a tiny stand-in directory, and the real lengths where WordNet is installed."""

from __future__ import annotations

import numpy as np
import pytest

from examples.varlen_data import (
    PARTS,
    gloss_lengths,
    length_statistics,
    read_wordnet_glosses,
    tokenize,
    wordnet_available,
)

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by\n"


def test_reads_class_and_gloss_and_skips_the_licence(tmp_path):
    lines = {
        "noun": '00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived; "an entity"\n',
        "verb": "00001740 29 v 04 breathe 0 | draw air into, and expel out of, the lungs\n",
        "adj": "00001740 00 a 01 able 0 | (usually followed by `to') having the necessary means\n",
        "adv": "00001740 02 r 01 barely 0 | by a small margin\n",
    }
    for part in PARTS:
        (tmp_path / f"data.{part}").write_text(HEADER + lines[part], encoding="latin-1")
    texts, labels = read_wordnet_glosses(tmp_path)
    assert labels == [3, 29, 0, 2]
    assert texts[1] == "draw air into, and expel out of, the lungs"
    assert gloss_lengths(tmp_path).tolist() == [len(tokenize(t)) for t in texts]
    assert tokenize('by a small margin; "ok"') == ["by", "a", "small", "margin", ";", '"', "ok", '"']


def test_missing_wordnet_says_how_to_install(tmp_path):
    assert not wordnet_available(tmp_path)
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base"):
        read_wordnet_glosses(tmp_path)


@pytest.mark.skipif(not wordnet_available(), reason="WordNet not installed (apt-get install wordnet-base)")
def test_real_gloss_lengths_vary_several_fold_within_a_batch():
    lengths = gloss_lengths()
    stats = length_statistics(lengths)
    assert stats["count"] > 100_000
    assert stats["p90"] >= 4 * stats["p10"]
    batches = np.random.default_rng(0).permutation(lengths)[: 64 * 100].reshape(100, 64)
    assert np.median(batches.max(axis=1) / batches.min(axis=1)) >= 4
