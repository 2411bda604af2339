import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# GPT-2 BPE files ship with the repo, so tokenization never needs the network.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO / "data" / "tiktoken_cache"))
