"""Voice: speaker linkability (resemblyzer EER) and intelligibility (pocketsphinx WER) of anonymised speech.

Corpus (``voice_corpus``): espeak-ng variants and flite voices reading ``SENTENCES``, plus natural
speech shipped by Debian packages when installed (``pocketsphinx-testdata``: a LibriVox reader
and the AN4 "cards" speaker; ``alsa-utils``: the speaker-test voice). Every utterance is its own
source, so the anonymiser draws its parameters per utterance.

Attackers (VoicePrivacy Challenge terms), each scored by resemblyzer cosine similarity between
a trial utterance and an enrolment utterance (always a *different* utterance):

- ignorant: anonymised trial vs original enrolment;
- lazy-informed: anonymised trial vs enrolment anonymised by the same method with the
  attacker's own key (a random draw of the same parameter distribution, not the tenant's).

EER is where false rejects of same-speaker pairs meet false accepts of different-speaker pairs;
50 % is chance, the original speech's EER shows that the encoder links these voices. ``rank1``
is the share of trials whose own speaker has the highest mean enrolment score (chance ``1/N``).
Intelligibility: pocketsphinx (en-us acoustic model, a closed-vocabulary unigram language model
of the corpus' words, so word order gives no help) word error rate before and after.
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from modalign.pipeline.deid_eval.common import need as _need, pct as _pct
from modalign.schemas.errors import DependencyMissingError
from modalign.schemas.policy import DeidPolicy

COMMON_SV_THRESHOLD = 0.80
VOICES = ("en-us+m3", "en+f2", "en+m1", "en+f4", "en-gb+m2", "en-us+f3", "en+m7", "en-gb-x-rp+f1")
FLITE_VOICES = ("slt", "rms", "awb", "kal")  # kal16 / awb_time are the same speakers as kal / awb
SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please send the quarterly report to the finance team before Friday.",
    "We will review the infrastructure budget after the planning meeting.",
)
PS_DATA = Path("/usr/share/pocketsphinx/test/data")
ALSA_SOUNDS = Path("/usr/share/sounds/alsa")
ALSA_TEXT = {"Front_Center": "front center", "Front_Left": "front left", "Front_Right": "front right",
             "Rear_Center": "rear center", "Rear_Left": "rear left", "Rear_Right": "rear right",
             "Side_Left": "side left", "Side_Right": "side right"}
# the quick slice (``deid-eval --quick``, the unit test): 10 speakers, about 25 s on one core
QUICK_VOICE: dict[str, Any] = {"voices": VOICES[:5], "flite_voices": FLITE_VOICES[:3], "natural": 2, "wer": True}
TENANT_KEY = b"deid-eval tenant key (evaluation only)"
ATTACKER_KEY = b"deid-eval attacker's own key"


@dataclass(frozen=True)
class Utterance:
    speaker: str  # e.g. "espeak:en+f2", "flite:slt", "natural:librivox"
    text: str  # reference transcript, lower case
    samples: np.ndarray  # mono float32, 16 kHz


def _to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    from scipy.signal import resample_poly

    if rate == 16000:
        return x.astype(np.float32)
    g = math.gcd(rate, 16000)
    return resample_poly(x, 16000 // g, rate // g).astype(np.float32)


def _wav_16k(data: bytes | Path) -> np.ndarray:
    with wave.open(io.BytesIO(data) if isinstance(data, bytes) else str(data)) as w:
        rate, ch, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        raw = w.readframes(w.getnframes())
    if width != 2:
        raise ValueError("only 16-bit WAV is read here")
    x = np.frombuffer(raw[: len(raw) // (2 * ch) * 2 * ch], dtype="<i2").astype(np.float64) / 32768.0
    return _to_16k(x.reshape(-1, ch).mean(axis=1), rate)


def espeak_16k(text: str, voice: str) -> np.ndarray:
    """espeak-ng speech of ``text`` in ``voice``, mono float32 at 16 kHz."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise DependencyMissingError("espeak-ng (speech for deid-eval)", apt="espeak-ng")
    proc = subprocess.run([exe, "-v", voice, "--stdout", text], capture_output=True, timeout=60, check=False)
    if proc.returncode != 0 or len(proc.stdout) < 64:
        raise DependencyMissingError(f"espeak-ng voice {voice}", apt="espeak-ng")
    return _wav_16k(proc.stdout)


def flite_16k(text: str, voice: str) -> np.ndarray:
    """flite speech of ``text`` in ``voice`` (``flite -lv``), mono float32 at 16 kHz."""
    exe = shutil.which("flite")
    if exe is None:
        raise DependencyMissingError("flite (speech for deid-eval)", apt="flite")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.wav"
        proc = subprocess.run([exe, "-voice", voice, "-t", text, "-o", str(out)], capture_output=True, timeout=60,
                              check=False)
        if proc.returncode != 0 or not out.exists():
            raise DependencyMissingError(f"flite voice {voice}", apt="flite")
        return _wav_16k(out)


def natural_speech(max_per_speaker: int = 8) -> dict[str, list[Utterance]]:
    """Recorded speech shipped by Debian packages, by speaker; empty for packages not installed."""
    out: dict[str, list[Utterance]] = {}

    def transcripts(path: Path) -> dict[str, str]:
        found = {}
        for line in path.read_text().splitlines():
            if "(" in line:
                words, _, fid = line.rpartition("(")
                found[fid.strip(" )")] = " ".join(w for w in words.split() if w not in ("<s>", "</s>"))
        return found

    for name, folder in (("natural:librivox", PS_DATA / "librivox"), ("natural:an4-cards", PS_DATA / "cards")):
        spec = folder / ("transcription" if name.endswith("librivox") else "cards.transcription")
        if spec.exists():
            utts = [Utterance(name, text, _wav_16k(folder / f"{fid}.wav"))
                    for fid, text in sorted(transcripts(spec).items()) if (folder / f"{fid}.wav").exists()]
            if len(utts) >= 2:
                out[name] = utts[:max_per_speaker]
    alsa = [Utterance("natural:alsa-speaker-test", text, _wav_16k(ALSA_SOUNDS / f"{f}.wav"))
            for f, text in ALSA_TEXT.items() if (ALSA_SOUNDS / f"{f}.wav").exists()]
    if len(alsa) >= 2:
        out["natural:alsa-speaker-test"] = alsa[:max_per_speaker]
    return out


def voice_corpus(voices: tuple[str, ...] = VOICES, flite_voices: tuple[str, ...] = FLITE_VOICES,
                 sentences: tuple[str, ...] = SENTENCES, natural: bool | int = True) -> dict[str, list[Utterance]]:
    """Utterances by speaker: espeak-ng ``voices`` and flite ``flite_voices`` reading ``sentences``, plus
    natural speech (``natural``: True = all found, an int = at most that many speakers)."""
    corpus: dict[str, list[Utterance]] = {}
    for v in voices:
        corpus[f"espeak:{v}"] = [Utterance(f"espeak:{v}", s.lower(), espeak_16k(s, v)) for s in sentences]
    for v in flite_voices:
        corpus[f"flite:{v}"] = [Utterance(f"flite:{v}", s.lower(), flite_16k(s, v)) for s in sentences]
    if natural:
        nat = natural_speech()
        keep = list(nat)[: (len(nat) if natural is True else int(natural))]
        corpus.update({k: nat[k] for k in keep})
    return corpus


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


def attack(trial: dict[tuple[str, int], np.ndarray], enrol: dict[tuple[str, int], np.ndarray]) -> dict[str, Any]:
    """Scores of every trial against every enrolment utterance of another index: EER, rank-1 rate, per speaker."""
    speakers = sorted({s for s, _ in enrol})
    same, diff, hits, per = [], [], 0, {}
    for (s, i), e in trial.items():
        mean_by = {}
        for t in speakers:
            scores = [float(e @ enrol[(t, j)]) for (t2, j) in enrol if t2 == t and j != i]
            if not scores:
                continue
            (same if t == s else diff).extend(scores)
            mean_by[t] = float(np.mean(scores))
        hits += max(mean_by, key=mean_by.get) == s
        per.setdefault(s, []).append(mean_by[s])
    same_a, diff_a = np.array(same), np.array(diff)
    thr, eer = eer_threshold(same_a, diff_a)
    return {"eer": eer, "threshold": thr, "same_mean": float(same_a.mean()), "diff_mean": float(diff_a.mean()),
            "rank1": hits / len(trial), "trials": len(trial),
            "per_speaker_same_mean": {s: float(np.mean(v)) for s, v in per.items()}}


def _decoder(words: set[str]) -> Any:
    """pocketsphinx decoder with a uniform unigram LM over ``words`` (those in its dictionary)."""
    ps = _need("pocketsphinx", "pocketsphinx==5.1.1")
    model = Path(ps.get_model_path()) / "en-us"
    dic = {line.split()[0] for line in (model / "cmudict-en-us.dict").read_text().splitlines() if line.strip()}
    vocab = sorted(w for w in words if w in dic)
    lp = -math.log10(len(vocab) + 1)
    arpa = "\\data\\\nngram 1=%d\n\n\\1-grams:\n" % (len(vocab) + 2)
    arpa += "-99.0 <s>\n%.4f </s>\n" % lp + "".join("%.4f %s\n" % (lp, w) for w in vocab) + "\n\\end\\\n"
    with tempfile.TemporaryDirectory(prefix="modalign-ps-") as d:  # the decoder reads the LM when built
        (Path(d) / "closed.arpa").write_text(arpa)
        return ps.Decoder(hmm=str(model / "en-us"), lm=str(Path(d) / "closed.arpa"),
                          dict=str(model / "cmudict-en-us.dict"), samprate=16000, loglevel="FATAL")


def _recognise(decoder: Any, x: np.ndarray) -> list[str]:
    pcm = np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes()
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr.split() if hyp is not None else []


def _edits(ref: list[str], hyp: list[str]) -> int:
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[-1]


def _words(text: str) -> list[str]:
    return "".join(c if c.isalpha() or c in " '" else " " for c in text.lower()).split()


def eval_voice(voices: tuple[str, ...] = VOICES, sentences: tuple[str, ...] = SENTENCES,
               alphas: tuple[float, ...] | None = None, policy: DeidPolicy | None = None, *,
               flite_voices: tuple[str, ...] = FLITE_VOICES, natural: bool | int = True, wer: bool = True) -> dict:
    """Linkability (both attackers) and WER of the policy's voice anonymisation on ``voice_corpus``.

    ``alphas``: also score the fixed-alpha McAdams transform (the old method) at these alphas
    against the ignorant and lazy-informed attackers, for comparison.
    """
    from modalign.operators.deid.voice import McAdamsTransform, anonymiser

    if len(sentences) < 2:
        raise ValueError("eval_voice needs at least two sentences: enrolment and trial are different utterances")
    policy = policy or DeidPolicy()
    torch = _need("torch", "torch")
    torch.set_num_threads(1)
    rz = _need("resemblyzer", "resemblyzer==0.1.4 --no-deps (+ librosa, webrtcvad-wheels)")
    encoder = rz.VoiceEncoder("cpu", verbose=False)
    embed = lambda x: encoder.embed_utterance(rz.preprocess_wav(x, 16000))  # noqa: E731
    corpus = voice_corpus(voices, flite_voices, sentences, natural)
    orig = {(s, i): u.samples for s, utts in corpus.items() for i, u in enumerate(utts)}
    e_orig = {k: embed(x) for k, x in orig.items()}
    secs = sum(x.size for x in orig.values()) / 16000
    tenant, attacker = anonymiser(policy.voice, TENANT_KEY), anonymiser(policy.voice, ATTACKER_KEY)
    t0 = time.process_time()
    anon = {k: tenant(x, 0, f"eval/{k[0]}/{k[1]}") for k, x in orig.items()}
    speed = secs / max(time.process_time() - t0, 1e-9)
    att = {k: attacker(x, 0, f"attacker/{k[0]}/{k[1]}") for k, x in orig.items()}
    e_anon = {k: embed(x) for k, x in anon.items()}
    e_att = {k: embed(x) for k, x in att.items()}
    same_utt = np.array([float(e_anon[k] @ e_orig[k]) for k in orig])
    report: dict[str, Any] = {
        "speakers": list(corpus), "utterances": len(orig), "seconds_of_speech": secs,
        "transform": tenant.name, "x_real_time": speed, "common_threshold": COMMON_SV_THRESHOLD,
        "original": attack(e_orig, e_orig),
        "ignorant": attack(e_anon, e_orig),
        "lazy_informed": attack(e_anon, e_att),
        "anon_vs_own_original_mean": float(same_utt.mean()), "anon_vs_own_original_max": float(same_utt.max()),
        "mcadams": {},
    }
    # the parameters were chosen on the even-numbered speakers: the odd ones are the held-out check
    for half, names in (("tuned_half", list(corpus)[0::2]), ("held_out_half", list(corpus)[1::2])):
        pick = lambda d: {k: v for k, v in d.items() if k[0] in names}  # noqa: E731
        report[half] = {"speakers": names, "ignorant": attack(pick(e_anon), pick(e_orig)),
                        "lazy_informed": attack(pick(e_anon), pick(e_att))}
    report["threshold"] = report["original"]["threshold"]
    report["eer"] = report["original"]["eer"]
    for alpha in alphas or ():
        tf = McAdamsTransform(alpha=alpha)
        e_m = {k: embed(tf(x)) for k, x in orig.items()}
        report["mcadams"][f"{alpha:.2f}"] = {"transform": tf.name, "ignorant": attack(e_m, e_orig),
                                            "lazy_informed": attack(e_m, e_m)}
    if wer:
        texts = {(s, i): u.text for s, utts in corpus.items() for i, u in enumerate(utts)}
        dec = _decoder({w for t in texts.values() for w in _words(t)})
        t1 = time.perf_counter()
        per: dict[str, list[int]] = {}
        for k in orig:
            ref = _words(texts[k])
            e0, e1 = _edits(ref, _recognise(dec, orig[k])), _edits(ref, _recognise(dec, anon[k]))
            acc = per.setdefault(k[0], [0, 0, 0])
            acc[0] += e0
            acc[1] += e1
            acc[2] += len(ref)
        total = np.array(list(per.values())).sum(axis=0)
        report["wer"] = {"before": total[0] / total[2], "after": total[1] / total[2], "words": int(total[2]),
                         "per_speaker": {s: (a / n, b / n) for s, (a, b, n) in per.items()},
                         "decode_seconds": time.perf_counter() - t1}
    return report


def render_voice(v: dict) -> list[str]:
    """Markdown lines of ``eval_voice``'s dict."""
    o, ig, li = v["original"], v["ignorant"], v["lazy_informed"]
    n = len(v["speakers"])
    lines = [
        "## Voice",
        f"{n} speakers ({', '.join(v['speakers'])}), {v['utterances']} utterances, {v['seconds_of_speech']:.0f} s; "
        f"resemblyzer cosine similarity, trial vs enrolment of another utterance. Anonymisation: `{v['transform']}` "
        f"({v['x_real_time']:.0f}x real time, one core). EER 50 % is chance; rank-1 chance is {_pct(1 / n)}.",
        "",
        "| attacker | trial | enrolment | EER | same / different speaker mean | rank-1 |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| none (before) | original | original | {_pct(o['eer'])} | {o['same_mean']:.3f} / {o['diff_mean']:.3f} | "
        f"{_pct(o['rank1'])} |",
        f"| ignorant | anonymised | original | {_pct(ig['eer'])} | {ig['same_mean']:.3f} / {ig['diff_mean']:.3f} | "
        f"{_pct(ig['rank1'])} |",
        f"| lazy-informed | anonymised | anonymised (own key) | {_pct(li['eer'])} | {li['same_mean']:.3f} / "
        f"{li['diff_mean']:.3f} | {_pct(li['rank1'])} |",
    ]
    for a, r in v.get("mcadams", {}).items():
        for name in ("ignorant", "lazy_informed"):
            lines.append(f"| {name.replace('_', '-')}, fixed McAdams {a} (old) | anonymised | "
                         f"{'original' if name == 'ignorant' else 'anonymised (same alpha)'} | {_pct(r[name]['eer'])} | "
                         f"{r[name]['same_mean']:.3f} / {r[name]['diff_mean']:.3f} | {_pct(r[name]['rank1'])} |")
    if "held_out_half" in v:
        t, h = v["tuned_half"], v["held_out_half"]
        lines += ["", f"Halves of the speakers (parameters chosen on the first): EER ignorant / lazy-informed "
                  f"{_pct(t['ignorant']['eer'])} / {_pct(t['lazy_informed']['eer'])} on {', '.join(t['speakers'])}; "
                  f"{_pct(h['ignorant']['eer'])} / {_pct(h['lazy_informed']['eer'])} held out "
                  f"({', '.join(h['speakers'])})."]
    lines += ["", f"Anonymised utterance vs its own original: mean {v['anon_vs_own_original_mean']:.3f}, max "
              f"{v['anon_vs_own_original_max']:.3f} (same-speaker EER threshold of the originals "
              f"{v['threshold']:.3f}; commonly used {v['common_threshold']:.2f}).", ""]
    if "wer" in v:
        w = v["wer"]
        lines += [f"Intelligibility (pocketsphinx en-us, closed-vocabulary unigram LM, {w['words']} words): WER "
                  f"{_pct(w['before'])} before, {_pct(w['after'])} after anonymisation.", "",
                  "| speaker | WER before | WER after | same-speaker score, ignorant | lazy-informed |",
                  "| --- | --- | --- | --- | --- |"]
        for s, (b, a) in w["per_speaker"].items():
            lines.append(f"| {s} | {_pct(b)} | {_pct(a)} | {ig['per_speaker_same_mean'][s]:.3f} | "
                         f"{li['per_speaker_same_mean'][s]:.3f} |")
        lines.append("")
    return lines
