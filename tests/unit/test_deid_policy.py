"""DeidPolicy: per-modality actions, per-entity text actions and thresholds, strict validation."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from modalign.schemas.config import RunConfig
from modalign.schemas.policy import ALL_TEXT_ENTITIES, DEFAULT_POLICY_TAG, DeidPolicy, FacePolicy, TextPolicy, VoicePolicy

pytestmark = pytest.mark.unit


def test_default_policy_tag_and_entities():
    pol = DeidPolicy()
    assert pol.tag == DEFAULT_POLICY_TAG
    assert re.fullmatch(r"modalign-default@10\+[0-9a-f]{8}", pol.tag)
    assert set(pol.text.entities) == set(ALL_TEXT_ENTITIES) >= {"address", "date_of_birth", "national_id"}
    assert (pol.face.action, pol.voice.action, pol.text.action) == ("blur_permute", "anonymise", "pseudonymise")


def test_per_entity_actions_and_thresholds_default_to_the_text_action():
    pol = TextPolicy(action="pseudonymise", actions={"ip": "mask", "card": "hash"}, min_scores={"address": 0.9})
    assert pol.action_for("ip") == "mask" and pol.action_for("card") == "hash"
    assert pol.action_for("person") == "pseudonymise"  # not listed: the default action
    assert pol.threshold_for("address") == 0.9 and pol.threshold_for("email") == pol.min_score == 0.5


def test_policy_loads_from_a_user_mapping_with_legal_basis():
    cfg = RunConfig.model_validate({"policy": {
        "policy_id": "acme-hr", "version": "2026-04", "legal_basis": "GDPR Art. 6(1)(f); DPIA-17",
        "text": {"action": "mask", "actions": {"person": "pseudonymise"}, "legal_basis": "Art. 89 research"},
        "voice": {"action": "anonymise", "mcadams_alpha_range": [0.7, 0.8]},
        "face": {"action": "mask"},
    }})
    assert cfg.policy.tag.startswith("acme-hr@2026-04+")
    assert cfg.policy.text.action_for("person") == "pseudonymise" and cfg.policy.text.action_for("ip") == "mask"
    assert cfg.policy.voice.mcadams_alpha_range == (0.7, 0.8) and cfg.policy.face.action == "mask"


def test_a_changed_policy_never_keeps_the_default_tag():
    """Defect: voice 'anonymise' set in a config still wrote modalign-default@3 (then the default)."""
    changed = [DeidPolicy(voice={"action": "keep_mfcc"}), DeidPolicy(face={"action": "mask"}),
               DeidPolicy(text={"actions": {"ip": "mask"}}), DeidPolicy(legal_basis="DPIA-1")]
    tags = [p.tag for p in changed]
    assert len(set(tags)) == len(tags) and DEFAULT_POLICY_TAG not in tags
    assert all(t.startswith("modalign-default@10+") for t in tags)
    assert DeidPolicy().tag == DeidPolicy.model_validate_json(DeidPolicy().model_dump_json()).tag  # stable


@pytest.mark.parametrize(
    "bad",
    [
        {"text": {"actions": {"passport": "mask"}}},  # unknown entity type
        {"text": {"actions": {"person": "encrypt"}}},  # unknown action
        {"text": {"entities": ["person", "shoe_size"]}},
        {"text": {"entities": ["email"], "actions": {"person": "mask"}}},  # listed but not detected
        {"text": {"min_scores": {"email": 1.5}}},
        {"face": {"action": "pseudonymise"}},  # not a face action
        {"voice": {"action": "pitch_shift"}},
        {"voice": {"action": "anonymise", "mcadams_alpha_range": [0.98, 1.0], "vtln_warp_range": [0.0, 0.0]}},  # no change
        {"voice": {"mcadams_alpha_range": [0.9, 0.6]}},  # not (low, high)
        {"voice": {"mcadams_alpha": 0.8}},  # the fixed alpha is gone: it was linkable
        {"face": {"temporal_window": 0}},  # tiles skipped on odd frames need the window
        {"sound": {"action": "drop"}},  # unknown modality
        {"policy_id": "a b"},
    ],
)
def test_invalid_policies_are_rejected(bad):
    with pytest.raises(ValidationError):
        DeidPolicy.model_validate(bad)


def test_window_zero_allowed_when_every_frame_is_tiled():
    assert FacePolicy(temporal_window=0, tile_every=1).temporal_window == 0
    assert FacePolicy(temporal_window=0, tiles=1).tiles == 1
    assert VoicePolicy(action="keep_mfcc", mcadams_alpha_range=(1.0, 1.0), vtln_warp_range=(0.0, 0.0)).action == "keep_mfcc"


def test_frame_text_reuse_threshold_is_a_policy_rule(tmp_path):
    """``policy.frame_text.reuse_threshold`` reaches the operator the video plan builds (0: every
    sample OCRed), and a changed threshold changes the policy tag."""
    from modalign.operators.modalities import DeidContext, plan_for

    built = {}
    for thr in (None, 0, 40):
        policy = {} if thr is None else {"frame_text": {"reuse_threshold": thr}}
        cfg = RunConfig.model_validate({"policy": policy})
        faces, frame_text = (build(DeidContext(cfg, "t", tmp_path)) for build in plan_for("video").deid)
        frame_text.setup()  # real tesseract: the detector name says whether reuse is on
        built[thr] = (frame_text.config.reuse_threshold, frame_text.detector_name, cfg.policy.tag)
    assert [b[0] for b in built.values()] == [24, 0, 40]
    assert "/reuse<24+" in built[None][1] and "/reuse" not in built[0][1] and "/reuse<40+" in built[40][1]
    assert built[None][2] == DEFAULT_POLICY_TAG and len({b[2] for b in built.values()}) == 3
    with pytest.raises(ValidationError):
        DeidPolicy(frame_text={"reuse_threshold": -1})
