"""A sentence-transformers BERT folder (all-MiniLM-L6-v2 and its kind) run in plain torch.

``TextEncoder`` (``operators.embed.text``) uses this for a folder it can read without
sentence-transformers: modules Transformer -> mean Pooling (-> Normalize), a ``bert`` config
with absolute positions and exact GELU, ``model.safetensors`` and a ``tokenizer.json``.
Importing sentence-transformers (and through it the whole of transformers) costs an embed
actor about 5 CPU s at start-up, more than embedding a 60 s session's slides; this module
needs torch, safetensors and tokenizers only (0.1 s on top of torch). Any other folder
(another architecture, pooling or tokenizer) goes to sentence-transformers as before.

The forward pass is BERT's: word + position + token-type embeddings, LayerNorm, then per layer
self-attention (padding masked), residual + LayerNorm, GELU feed-forward, residual +
LayerNorm; the sentence vector is the mean of the last layer over the real tokens, L2
normalised. Tokenisation is the folder's own ``tokenizer.json`` (lower-casing, word pieces,
``[CLS] ... [SEP]``), texts stripped and cut at ``max_seq_length`` word pieces like
sentence-transformers does; batches are formed over texts sorted by length, so padding is
short. Same vectors as sentence-transformers to float rounding (the tests compare them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from modalign.operators.dependencies import require

MEAN_POOLING = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
                "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
           "sentence_transformers.models.Normalize")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def readable(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a folder this module runs exactly as sentence-transformers would."""
    modules = _json(model_dir / "modules.json")
    if not isinstance(modules, list) or not 2 <= len(modules) <= 3:
        return False
    types = tuple(m.get("type") for m in modules if isinstance(m, dict))
    if types != MODULES[:len(modules)] or modules[0].get("path") not in ("", "."):
        return False
    pooling = _json(model_dir / modules[1].get("path", "") / "config.json")
    if not isinstance(pooling, dict) or any(pooling.get(k, False) != v for k, v in MEAN_POOLING.items()):
        return False
    if any(pooling.get(k) for k in ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")):
        return False
    st = _json(model_dir / "sentence_bert_config.json")
    if not isinstance(st, dict) or not isinstance(st.get("max_seq_length"), int):
        return False
    cfg = _json(model_dir / "config.json")
    if not isinstance(cfg, dict) or cfg.get("model_type") != "bert" or cfg.get("hidden_act") != "gelu":
        return False
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        return False
    return (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()


class BertSentenceEncoder:
    """The folder's network and tokenizer; ``encode`` gives (N, dim) float32 L2-normalised vectors."""

    def __init__(self, model_dir: Path, max_seq_length: int, device: str = "cpu") -> None:
        torch = require("torch")
        tokenizers = require("tokenizers")
        safetensors_torch = require("safetensors.torch")
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        self.layers = int(cfg["num_hidden_layers"])
        self.heads = int(cfg["num_attention_heads"])
        self.dim = int(cfg["hidden_size"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.max_seq_length = int(min(max_seq_length, cfg.get("max_position_embeddings", max_seq_length)))
        self.lower = bool((_json(model_dir / "sentence_bert_config.json") or {}).get("do_lower_case", False))
        self.device = device
        weights = safetensors_torch.load_file(str(model_dir / "model.safetensors"), device=device)
        # BertModel's own names; a folder saved from a model with a head prefixes them with "bert."
        self.w = {k.removeprefix("bert."): v.float() for k, v in weights.items()}
        self.tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=self.max_seq_length)
        self.tokenizer.no_padding()
        self._torch = torch

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Vectors of ``texts`` in input order."""
        torch = self._torch
        texts = [t.strip().lower() if self.lower else t.strip() for t in texts]
        ids = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.zeros((len(ids), self.dim), np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            batch = np.zeros((len(rows), width), np.int64)
            mask = np.zeros((len(rows), width), bool)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])] = ids[i]
                mask[r, :len(ids[i])] = True
            with torch.inference_mode():
                vecs = self._forward(torch.from_numpy(batch).to(self.device), torch.from_numpy(mask).to(self.device))
            out[rows] = vecs.float().cpu().numpy()
        return out

    def _forward(self, ids: Any, mask: Any) -> Any:
        torch = self._torch
        F = torch.nn.functional
        w, eps, d = self.w, self.eps, self.dim
        n, length = ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:length][None]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = F.layer_norm(x, (d,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        keep = mask[:, None, None, :]  # (n, 1, 1, length): every query sees the real tokens only
        head = d // self.heads

        def linear(v: Any, name: str) -> Any:
            return F.linear(v, w[name + ".weight"], w[name + ".bias"])

        def split(v: Any) -> Any:
            return v.view(n, length, self.heads, head).transpose(1, 2)

        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (split(linear(x, p + "attention.self." + m)) for m in ("query", "key", "value"))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0 / math.sqrt(head))
            att = att.transpose(1, 2).reshape(n, length, d)
            x = F.layer_norm(x + linear(att, p + "attention.output.dense"), (d,),
                             w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
            h = F.gelu(linear(x, p + "intermediate.dense"))
            x = F.layer_norm(x + linear(h, p + "output.dense"), (d,),
                             w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        m = mask[:, :, None].to(x.dtype)
        pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1)
