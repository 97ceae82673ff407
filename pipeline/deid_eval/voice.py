"""Voice: speaker linkability (resemblyzer) of anonymised speech."""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import time
import wave
from typing import Any

import numpy as np

from modalign.pipeline.deid_eval.common import need as _need, pct as _pct
from modalign.schemas.errors import DependencyMissingError
from modalign.schemas.policy import DeidPolicy

COMMON_SV_THRESHOLD = 0.80
VOICES = ("en-us+m3", "en+f2", "en+m1", "en+f4", "en-gb+m2", "en-us+f3", "en+m7", "en-gb-x-rp+f1")
SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please send the quarterly report to the finance team before Friday.",
    "We will review the infrastructure budget after the planning meeting.",
)


def espeak_16k(text: str, voice: str) -> np.ndarray:
    """espeak-ng speech of ``text`` in ``voice``, mono float32 at 16 kHz."""
    from scipy.signal import resample_poly

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise DependencyMissingError("espeak-ng (speech for deid-eval)", apt="espeak-ng")
    proc = subprocess.run([exe, "-v", voice, "--stdout", text], capture_output=True, timeout=60, check=False)
    if proc.returncode != 0 or len(proc.stdout) < 64:
        raise DependencyMissingError(f"espeak-ng voice {voice}", apt="espeak-ng")
    with wave.open(io.BytesIO(proc.stdout)) as w:
        rate = w.getframerate()
        raw = w.readframes(w.getnframes())
    x = np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2").astype(np.float64) / 32768.0
    g = math.gcd(rate, 16000)
    return resample_poly(x, 16000 // g, rate // g).astype(np.float32)


def eer_threshold(same: np.ndarray, diff: np.ndarray) -> tuple[float, float]:
    """(threshold, EER): where the false-reject rate of ``same`` meets the false-accept rate of ``diff``."""
    cands = np.unique(np.concatenate([same, diff]))
    best = (1.0, 0.0, 1.0)
    for t in cands:
        frr = float((same < t).mean())
        far = float((diff >= t).mean())
        gap = abs(frr - far)
        if gap < best[0] or (gap == best[0] and t > best[1]):
            best = (gap, float(t), (frr + far) / 2)
    return best[1], best[2]


def _vad_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of 30 ms frames on which webrtcvad (mode 2) gives the same decision."""
    vad_mod = _need("webrtcvad", "webrtcvad-wheels==2.0.14.post1")
    vad = vad_mod.Vad(2)
    n = 480
    to_pcm = lambda x: np.clip(np.round(x * 32767), -32768, 32767).astype("<i2")  # noqa: E731
    pa_, pb = to_pcm(a), to_pcm(b)
    same = total = 0
    for i in range(0, min(len(pa_), len(pb)) - n + 1, n):
        total += 1
        same += vad.is_speech(pa_[i:i + n].tobytes(), 16000) == vad.is_speech(pb[i:i + n].tobytes(), 16000)
    return same / total if total else float("nan")


def eval_voice(voices: tuple[str, ...] = VOICES, sentences: tuple[str, ...] = SENTENCES,
               alphas: tuple[float, ...] | None = None, policy: DeidPolicy | None = None) -> dict:
    """Speaker similarity before/after McAdams anonymisation (resemblyzer, cosine)."""
    from modalign.operators.deid.voice import McAdamsTransform

    policy = policy or DeidPolicy()
    torch = _need("torch", "torch")
    torch.set_num_threads(1)
    rz = _need("resemblyzer", "resemblyzer==0.1.4 --no-deps (+ librosa, webrtcvad-wheels)")
    encoder = rz.VoiceEncoder("cpu", verbose=False)
    embed = lambda x: encoder.embed_utterance(rz.preprocess_wav(x, 16000))  # noqa: E731
    orig = {(v, i): espeak_16k(s, v) for v in voices for i, s in enumerate(sentences)}
    e_orig = {k: embed(x) for k, x in orig.items()}
    same = np.array([e_orig[(v, i)] @ e_orig[(v, j)] for v in voices for i in range(len(sentences))
                     for j in range(i + 1, len(sentences))])
    diff = np.array([e_orig[(v, i)] @ e_orig[(w, j)] for v in voices for w in voices if v < w
                     for i in range(len(sentences)) for j in range(len(sentences))])
    thr, eer = eer_threshold(same, diff)
    report: dict[str, Any] = {
        "voices": list(voices), "utterances": len(orig), "threshold": thr, "threshold_basis": "EER on this set",
        "eer": eer, "common_threshold": COMMON_SV_THRESHOLD,
        "same_speaker_mean": float(same.mean()), "same_speaker_min": float(same.min()),
        "diff_speaker_mean": float(diff.mean()), "diff_speaker_max": float(diff.max()),
        "alphas": {}, "policy_alpha": policy.voice.mcadams_alpha,
    }
    alphas = alphas or (policy.voice.mcadams_alpha,)
    for alpha in alphas:
        tf = McAdamsTransform(alpha=alpha)
        # anonymise the first two utterances of each voice (the third stays original-only)
        keys = [(v, i) for v in voices for i in range(min(2, len(sentences)))]
        t0 = time.perf_counter()
        anon = {k: tf(orig[k]) for k in keys}
        secs = sum(len(orig[k]) for k in keys) / 16000
        speed = secs / (time.perf_counter() - t0)
        e_anon = {k: embed(x) for k, x in anon.items()}
        same_utt = np.array([e_anon[k] @ e_orig[k] for k in keys])
        other_utt = np.array([e_anon[(v, i)] @ e_orig[(v, j)] for (v, i) in keys for j in range(len(sentences))
                              if j != i])
        anon_anon = np.array([e_anon[(v, 0)] @ e_anon[(v, 1)] for v in voices]) if len(sentences) > 1 else np.array([])
        report["alphas"][f"{alpha:.2f}"] = {
            "transform": tf.name,
            "anon_vs_orig_same_utt_mean": float(same_utt.mean()), "anon_vs_orig_same_utt_max": float(same_utt.max()),
            "anon_vs_orig_other_utt_mean": float(other_utt.mean()),
            "accepted_at_threshold": float((np.concatenate([same_utt, other_utt]) >= thr).mean()),
            "accepted_at_common": float((np.concatenate([same_utt, other_utt]) >= COMMON_SV_THRESHOLD).mean()),
            "anon_vs_anon_same_voice_mean": float(anon_anon.mean()) if anon_anon.size else float("nan"),
            "vad_agreement": float(np.mean([_vad_agreement(orig[k], anon[k]) for k in keys])),
            "x_real_time": speed,
        }
    return report


def render_voice(v: dict) -> list[str]:
    """Markdown lines of ``eval_voice``'s dict."""
    lines: list[str] = []
    lines += [
        "## Voice",
        f"{len(v['voices'])} espeak-ng voices x {v['utterances'] // len(v['voices'])} utterances, resemblyzer "
        f"cosine similarity. Same-speaker threshold {v['threshold']:.3f} = the EER threshold of the original "
        f"same-voice/different-voice pairs (EER {_pct(v['eer'])}); the commonly used {v['common_threshold']:.2f} "
        "is shown beside it. espeak voices share one synthesiser, so different voices already score high "
        f"(mean {v['diff_speaker_mean']:.3f}, max {v['diff_speaker_max']:.3f}); same voice: mean "
        f"{v['same_speaker_mean']:.3f}, min {v['same_speaker_min']:.3f}.",
        "",
        "| McAdams alpha | anon vs original (same utt.), mean / max | anon vs original (other utt.) | accepted "
        f"at {v['threshold']:.3f} | accepted at {v['common_threshold']:.2f} | anon vs anon, same voice | VAD "
        "agreement | x real time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a, r in v["alphas"].items():
        lines.append(
            f"| {a} | {r['anon_vs_orig_same_utt_mean']:.3f} / {r['anon_vs_orig_same_utt_max']:.3f} | "
            f"{r['anon_vs_orig_other_utt_mean']:.3f} | {_pct(r['accepted_at_threshold'])} | "
            f"{_pct(r['accepted_at_common'])} | {r['anon_vs_anon_same_voice_mean']:.3f} | "
            f"{_pct(r['vad_agreement'])} | {r['x_real_time']:.0f} |"
        )
    lines += ["", "Before anonymisation: original vs another utterance of the same voice, mean "
              f"{v['same_speaker_mean']:.3f}. Anonymised speech of one voice still matches itself "
              "(a consistent pseudo-voice): an attacker who anonymises enrolment speech with the same alpha "
              "is not defeated.", ""]
    return lines
