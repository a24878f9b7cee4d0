"""Real variable-length text that works offline: the WordNet glosses from Debian's ``wordnet-base``.

Each line of ``/usr/share/wordnet/data.{noun,verb,adj,adv}`` is one synset: its second field is the lexicographer
class (45 classes), the text after ``" | "`` its gloss (a definition, often with quoted examples). The glosses' token
counts vary several-fold within any batch, which is what cost-aware splitting is for. Install the data with
``apt-get install wordnet-base``; :func:`wordnet_available` tells whether it is there.

Pure Python and numpy: importing it costs nothing, so benchmarks that only need the lengths stay fast.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

WORDNET_DIR = Path("/usr/share/wordnet")
PARTS = ("noun", "verb", "adj", "adv")
# words and single punctuation marks: roughly what a word-level tokenizer counts
_TOKEN = re.compile(r"\w+|[^\w\s]")


def wordnet_available(directory: Path = WORDNET_DIR) -> bool:
    """Whether the WordNet data files are installed."""
    return all((directory / f"data.{part}").exists() for part in PARTS)


def read_wordnet_glosses(directory: Path = WORDNET_DIR) -> tuple[list[str], list[int]]:
    """``(glosses, classes)``: every synset's gloss and its lexicographer class (0..44), in file order.

    Raises:
        FileNotFoundError: WordNet is not installed (says how to install it).

    """
    if not wordnet_available(directory):
        raise FileNotFoundError(f"WordNet not found in {directory}; install it with `apt-get install wordnet-base`.")
    texts, labels = [], []
    for part in PARTS:
        for line in (directory / f"data.{part}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            labels.append(int(line.split(" ")[1]))
            texts.append(line.split(" | ", 1)[1])
    return texts, labels


def tokenize(text: str) -> list[str]:
    """Lower-cased words and punctuation marks."""
    return _TOKEN.findall(text.lower())


def gloss_lengths(directory: Path = WORDNET_DIR) -> np.ndarray:
    """Every gloss's token count (the per-sample cost of a model that runs over its tokens)."""
    texts, _ = read_wordnet_glosses(directory)
    return np.array([len(tokenize(text)) for text in texts], dtype=np.int64)


def length_statistics(lengths: np.ndarray) -> dict[str, float]:
    """Count, min, 10th percentile, median, mean, 90th percentile and max of a set of lengths."""
    values = np.asarray(lengths, dtype=np.float64)
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return {
        "count": int(values.size),
        "min": float(values.min()),
        "p10": float(p10),
        "median": float(median),
        "mean": float(values.mean()),
        "p90": float(p90),
        "max": float(values.max()),
    }
