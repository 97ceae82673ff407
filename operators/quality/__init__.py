"""Modality quality: per-record properties of the decoded signal, expectations on them, and the
distribution-shift check against a reference run.

Ray-free and I/O-free (arrays and Arrow tables in, numbers and tables out):

- ``video.frame_quality``: brightness, contrast and sharpness of a decoded RGB frame;
- ``audio.AudioQualityMeter``: loudness, clipping ratio and speech-to-noise estimate per MFCC frame;
- ``text.ocr_confidence``: mean word confidence of an OCR text block;
- ``gate.QualityGate``: the ``warn | drop | fail`` expectations over a stream of event tables;
- ``shift``: PSI over reference-quantile bins and the mean shift in reference standard deviations.

The ingest operators call the first three on the signal before de-identification (the properties of
the camera, microphone or scan: scalar statistics, never personal data); ``pipeline.worker`` applies
the gate before events are written; ``pipeline.quality`` runs the shift check at every commit.
"""
