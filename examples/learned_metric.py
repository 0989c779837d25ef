"""A metric learned from the gradients against fixed ones: SOAP (the kronecker geometry, method soap,
on the hidden matrices), Muon (muon.yaml: the spectral map) and AdamW (adam-all.yaml: Adam's
diagonal everywhere) on char_gpt's byte-level GPT, from the same seeds.

Model, data and loop: examples/char_gpt.py's (geomopt.models.GPT, 2 layers, 4 heads, width 64,
context 64, on pydoc's bundled topic help; the demo's training). Each spec's own lrs, linear decay
to 10%. Every optimizer starts each seed from the same weights and sees the same batches.

  SOAP    soap-gpt.yaml   SOAP on hidden matrices, AdamW on embeddings, head and the rest
  Muon    muon.yaml       Muon on hidden matrices, AdamW on the rest
  AdamW   adam-all.yaml   AdamW everywhere

Run:  python examples/learned_metric.py                  # 3 seeds, 600 steps each
      python examples/learned_metric.py --record         # rewrite examples/results/learned_metric.*
Writes learned_metric.json and learned_metric.png (the first seed's curves) to --out (default
runs/learned_metric/).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import char_gpt  # noqa: E402

OPTIMIZERS = {"SOAP": "soap-gpt", "Muon": "muon", "AdamW": "adam-all"}


def main(argv=None) -> int:
    return char_gpt.main(argv, key="learned_metric", optimizers=OPTIMIZERS, seeds=3, doc=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
