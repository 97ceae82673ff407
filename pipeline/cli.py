"""The ``modalign`` command line.

Exit codes: 0 success; 1 failure (bad config or manifest, or an error that stopped the
run); 3 the run completed but some inputs (or ranges) were quarantined - see
``OUT/quarantine/`` and ``modalign inspect OUT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from modalign.schemas.errors import ModalignError

# modalign.pipeline.metrics.WATCH_PORT and DEFAULT_HOST, not imported here so that --help stays light
WATCH_PORT = 9464
METRICS_HOST = "127.0.0.1"

EXAMPLES = {
    "sample": "modalign sample ./sample --duration 12",
    "run": "modalign run ./sample/manifest.yaml --out ./out",
    "watch": "modalign watch ./incoming --out ./out --interval 5 --settle 10 --max-in-flight 2  (or --once, from cron)",
    "inspect": "modalign inspect ./out",
    "export": "modalign export ./out --format webdataset --clip-s 2 --out ./shards --split 0.9,0.1 --seed 0",
    "report": "modalign report ./out --out report.html",
    "deid-eval": "modalign deid-eval --quick",
    "search": "modalign search ./out --text 'vendor contracts' -k 3",
    "cache": "modalign cache stats ./out",
    "lineage trace": "modalign lineage trace ./out sample-meeting/slides/block/1  (or a feature id, "
                     "sample-meeting:42, records/sample-meeting/FILE.parquet)",
    "lineage access": "modalign lineage access ./out --subject subject-0001 --format html --out access.html",
    "lineage erase": "modalign lineage erase ./out --subject subject-0001 --dry-run  (then without --dry-run)",
    "lineage verify": "modalign lineage verify ./out/lineage/erasure/ERASURE_ID.json --subject subject-0001",
}


def cmd_sample(args: argparse.Namespace) -> int:
    from modalign.pipeline.sample import generate_sample

    manifest = generate_sample(Path(args.dir), duration_s=args.duration, seed=args.seed)
    print(json.dumps({"manifest": str(manifest)}) if args.json else f"sample session written: {manifest}")
    return 0


def _metrics(args: argparse.Namespace, default_port: int | None = None):
    """The metrics of this command, served on ``--metrics-host:--metrics-port`` (0: not served).

    A port given and in use stops the command (EnvironmentFaultError); the default port in use
    (another watch on this machine) is said, and the command goes on without the endpoint."""
    from modalign.pipeline.metrics import Metrics
    from modalign.schemas.errors import EnvironmentFaultError

    metrics = Metrics()
    port = default_port if args.metrics_port is None else args.metrics_port
    if port:
        try:
            metrics.serve(port, args.metrics_host)
        except EnvironmentFaultError as exc:
            if args.metrics_port is not None:
                raise
            args.display.message(f"metrics not served: {exc.message}", "warning")
        else:
            args.display.message(f"metrics: {metrics.url}")
    return metrics


def _with_options(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with what ``--address`` and ``--reference`` set (run and watch)."""
    if args.address:
        config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"address": args.address})})
    if args.reference:
        config = config.model_copy(update={"monitor": config.monitor.model_copy(update={"reference": args.reference})})
    return config


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from modalign.pipeline.runner import Runner, resolve_config

    config = _with_options(resolve_config(args.config), args)
    metrics = _metrics(args)
    try:
        summary = Runner(config, args.out, progress=args.display.message, metrics=metrics,
                         display=args.display).run(args.input)  # a path or s3://
        if metrics.port and args.metrics_linger > 0:  # a last scrape sees the final values
            time.sleep(args.metrics_linger)
    finally:
        metrics.close()
        args.display.close()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        from modalign.pipeline.inspect import collect, render

        print(render(collect(args.out, config.storage)))
        where = args.out if args.out.startswith("s3://") else Path(args.out).resolve()
        print(f"\noutputs: {where}  (details: modalign inspect {args.out})")
    return summary["exit_code"]


def cmd_watch(args: argparse.Namespace) -> int:
    from modalign.pipeline.runner import resolve_config
    from modalign.pipeline.watch import Watch, listing_for

    config = _with_options(resolve_config(args.config), args)
    metrics = _metrics(args, WATCH_PORT)
    watch = Watch(config, listing_for(args.input, args.out, config), args.out, interval_s=args.interval,
                  settle_s=args.settle, max_in_flight=args.max_in_flight, once=args.once,
                  progress=args.display.message, report_every_s=args.report_every, metrics=metrics,
                  lease_wait_s=args.lease_wait, display=args.display)
    try:
        status = watch.run(handle_signals=True)
    finally:
        metrics.close()
        args.display.close()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    return status["exit_code"]


def cmd_inspect(args: argparse.Namespace) -> int:
    from modalign.pipeline.inspect import collect, render

    info = collect(args.out)  # a folder, or s3://bucket/prefix (endpoint: $AWS_ENDPOINT_URL)
    print(json.dumps(info, indent=2, default=str) if args.json else render(info))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from modalign import open as open_output
    from modalign.pipeline.export import export

    modalities = args.modalities.split(",") if args.modalities else None
    features = True if args.features == "all" else (args.features.split(",") if args.features else None)
    summary = export(open_output(args.out), args.format, args.dest, clip_s=args.clip_s, stride_s=args.stride_s,
                     split=args.split, seed=args.seed, samples_per_shard=args.samples_per_shard,
                     progress=None if args.json else print, modalities=modalities, features=features)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from modalign.pipeline.report import plots_in, write_run_report

    # a folder, or s3://bucket/prefix (endpoint: $AWS_ENDPOINT_URL); FILE is refused inside OUT before any reading
    path, page = write_run_report(args.out, args.report)
    if args.json:
        print(json.dumps({"report": str(path), "plots": plots_in(page), "bytes": len(page.encode("utf-8"))}))
    else:
        print(f"run report of {args.out}: {path}  ({plots_in(page)} plots, {len(page.encode('utf-8')) // 1024} KiB)")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from modalign.pipeline.search import render_results, search

    results = search(args.out, image=Path(args.image) if args.image else None, text=args.text,
                     record=args.record, granularity=args.granularity, k=args.k)
    print(json.dumps(results, indent=2) if args.json else render_results(results))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from modalign.pipeline.cache_admin import cache_gc, cache_stats, render_stats

    result = cache_stats(args.out) if args.action == "stats" else cache_gc(args.out, dry_run=args.dry_run)
    print(json.dumps(result, indent=2) if args.json else render_stats(result))
    return 0


def cmd_lineage_trace(args: argparse.Namespace) -> int:
    from modalign.pipeline.lineage import render_trace, to_json, trace

    result = trace(args.out, args.id)
    print(to_json(result) if args.json else render_trace(result))
    return 0


def cmd_lineage_access(args: argparse.Namespace) -> int:
    from modalign.pipeline.lineage import access, render_access, render_access_html, to_json, write_report

    fmt = "json" if args.json else args.format
    report = access(args.out, args.subject, registry=args.registry, key_store=args.key_store)
    text = {"json": to_json, "html": render_access_html, "text": render_access}[fmt](report)
    if args.report:
        path = write_report(args.report, text, args.out)
        print(f"access report ({fmt}) for subject {report['subject']}: {path}  "
              f"({', '.join(f'{k} {v}' for k, v in report['counts'].items())})")
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def cmd_lineage_erase(args: argparse.Namespace) -> int:
    from modalign.pipeline.erasure import erase, render_erasure
    from modalign.pipeline.lineage import to_json

    report = erase(args.out, subject=args.subject, source=args.source, scope=args.scope, dry_run=args.dry_run,
                   key_store=args.key_store, progress=None if args.json else args.display.message, registry=args.registry,
                   mentions=not args.keep_mentions)
    print(to_json(report) if args.json else render_erasure(report))
    return 0


def cmd_lineage_verify(args: argparse.Namespace) -> int:
    from modalign.pipeline.erasure import render_verify, verify
    from modalign.pipeline.lineage import to_json

    result = verify(Path(args.report), out=args.out, key_store=args.key_store, subject=args.subject)
    print(to_json(result) if args.json else render_verify(result))
    return 0 if result["ok"] else 1


def cmd_deid_eval(args: argparse.Namespace) -> int:
    import tempfile

    from modalign.pipeline.deid_eval import render, run_eval, to_json
    from modalign.pipeline.runner import resolve_config

    config = resolve_config(args.config)
    with tempfile.TemporaryDirectory(prefix="modalign-deid-eval-") as tmp:
        report = run_eval(Path(args.work_dir) if args.work_dir else Path(tmp), quick=args.quick, policy=config.policy)
    print(json.dumps(to_json(report), indent=2) if args.json else render(report))
    return 0


def _metrics_options(sp: argparse.ArgumentParser, default: str) -> None:
    sp.add_argument("--metrics-port", type=int, metavar="N",
                    help=f"serve Prometheus metrics on http://HOST:N/metrics ({default})")
    sp.add_argument("--metrics-host", default=METRICS_HOST, metavar="HOST",
                    help=f"address the metrics endpoint binds (default {METRICS_HOST}; 0.0.0.0 in a pod)")


def _display_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-q", "--quiet", action="store_true",
                    help="no progress and no informational messages on stderr (warnings and errors still)")
    sp.add_argument("--log-format", choices=["text", "json"], default="text",
                    help="stderr as text (progress bars on a terminal, plain lines otherwise; default) or one "
                         "JSON object per line (messages, progress, logs)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modalign",
        description="Streaming multimodal data pipeline: ingest, align, de-identify, embed, with lineage.",
        epilog="exit codes: 0 ok, 1 failure, 3 completed with quarantined inputs",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, fn) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, epilog=f"example: {EXAMPLES[name]}")
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        _display_options(sp)
        return sp

    sp = add("sample", "generate a realistic sample session (video, lapel audio, slides PDF, manifest)", cmd_sample)
    sp.add_argument("dir", help="folder to write the session into")
    sp.add_argument("--duration", type=float, default=12.0, help="seconds (default 12)")
    sp.add_argument("--seed", type=int, default=0)

    sp = add("run", "run the batch pipeline over a manifest, a folder or a media file", cmd_run)
    sp.add_argument("input", help="manifest (.yaml/.json), folder of manifests/media, or one media file; or "
                    "s3://bucket/prefix (a prefix of manifests/media objects, or one object's key)")
    sp.add_argument("--out", required=True, help="output folder")
    sp.add_argument("--address", help="Ray cluster address (e.g. auto); default: a local Ray")
    sp.add_argument("--config", help="run configuration (YAML/JSON); see schemas/config.py")
    sp.add_argument("--reference", metavar="OUT0", help="another output whose committed features are the "
                    "embedding monitor's reference (default: the first windows of OUT; runbooks/embedding-drift.md)")
    _metrics_options(sp, "default: not served")
    sp.add_argument("--metrics-linger", type=float, default=0.0, metavar="S",
                    help="keep the metrics endpoint up S seconds after the run, for a last scrape (default 0)")

    sp = add("watch", "process the sessions that land in a folder, each version exactly once, until stopped "
             "(SIGTERM/Ctrl-C: the sessions in flight commit, then it exits; twice: they are abandoned)", cmd_watch)
    sp.add_argument("input", help="folder or s3://bucket/prefix to watch (its manifests, and media files no "
                    "manifest names)")
    sp.add_argument("--out", required=True, help="output folder (its lease is held while the watch runs)")
    sp.add_argument("--interval", type=float, default=5.0, metavar="S", help="seconds between listings (default 5)")
    sp.add_argument("--settle", type=float, default=10.0, metavar="S",
                    help="seconds a session's files must stay unchanged before it is processed (default 10)")
    sp.add_argument("--max-in-flight", type=int, default=1, metavar="N",
                    help="sessions processed (and committed) together at most (default 1)")
    sp.add_argument("--once", action="store_true", help="process what is ready now, then exit (tests, cron)")
    sp.add_argument("--lease-wait", type=float, default=0.0, metavar="S",
                    help="if another writer holds OUT, wait up to S seconds for its lease to be released or to go "
                         "stale (a watch restarted after a kill: its old lease goes stale after runtime.lease_ttl_s); "
                         "default 0: refuse at once")
    sp.add_argument("--report-every", type=float, default=60.0, metavar="S",
                    help="seconds between status lines while idle (default 60)")
    sp.add_argument("--address", help="Ray cluster address (e.g. auto); default: a local Ray")
    sp.add_argument("--config", help="run configuration (YAML/JSON); see schemas/config.py")
    sp.add_argument("--reference", metavar="OUT0", help="another output whose committed features are the "
                    "embedding monitor's reference (default: the first windows of OUT; runbooks/embedding-drift.md)")
    _metrics_options(sp, f"default {WATCH_PORT}, or none if another process holds it; 0: not served")

    sp = add("deid-eval", "measure de-identification efficacy (text recall/F2, face re-detection and linkability, "
             "voice linkability) on generated data", cmd_deid_eval)
    sp.add_argument("--quick", action="store_true", help="smaller sets (about 20 s instead of 80 s)")
    sp.add_argument("--work-dir", help="keep the generated evaluation data here (default: a temp dir)")
    sp.add_argument("--config", help="run configuration whose de-identification policy is evaluated")

    sp = add("inspect", "print a human summary of an output folder", cmd_inspect)
    sp.add_argument("out", help="output folder of `modalign run`")

    sp = add("export", "write the aligned samples of an output folder as training shards (WebDataset tar or one "
             "Parquet file per split), sessions split by a seeded hash so that none is in two splits", cmd_export)
    sp.add_argument("out", help="output folder of `modalign run` (or s3://bucket/prefix)")
    sp.add_argument("--format", required=True, choices=["webdataset", "parquet"])
    sp.add_argument("--clip-s", type=float, required=True, metavar="S", help="seconds of session time per sample")
    sp.add_argument("--stride-s", type=float, metavar="S", help="seconds between clip starts (default: --clip-s)")
    sp.add_argument("--out", dest="dest", required=True, metavar="DIR", help="folder to write (outside OUT)")
    sp.add_argument("--split", default=None, metavar="F,F", help="fractions of sessions per split, e.g. 0.9,0.1 "
                    "(train,val; three: train,val,test); default: one split, train")
    sp.add_argument("--seed", type=int, default=0, help="seed of the session split (default 0)")
    sp.add_argument("--modalities", metavar="M,M", help="some of video,audio,pdf (default all)")
    sp.add_argument("--features", metavar="M/G,..", help="embeddings to add: all, or MODALITY/GRANULARITY names "
                    "(video/frame,pdf/roi); default none")
    sp.add_argument("--samples-per-shard", type=int, default=1000, metavar="N", help="webdataset: samples per tar")

    sp = add("report", "write a self-contained HTML page of an output folder's latest commit (residuals, clocks "
             "and drift, CTAL decisions, de-identification counts, quarantine, throughput, cache, monitors; "
             "statistics only, plots inline)", cmd_report)
    sp.add_argument("out", help="output folder of `modalign run` (or s3://bucket/prefix)")
    sp.add_argument("--out", dest="report", metavar="FILE", default="report.html",
                    help="the HTML file to write, outside OUT (default report.html in the current folder)")

    sp = add("search", "nearest records to an image, a text or a stored record (FAISS index of OUT)", cmd_search)
    sp.add_argument("out", help="output folder of `modalign run`")
    q = sp.add_mutually_exclusive_group(required=True)
    q.add_argument("--image", help="image file (JPEG/PNG): searches the image model's index")
    q.add_argument("--text", help="query text: searches the text blocks (roi) of the text model")
    q.add_argument("--record", help="an event_id or feature_id: its stored vector, itself first")
    sp.add_argument("--granularity", choices=["frame", "roi", "patch"],
                    help="default: frame for --image, roi for --text, the record's own for --record")
    sp.add_argument("-k", type=int, default=5, help="results (default 5)")

    sp = add("cache", "feature cache of an output folder: stats, or gc of entries no feature row uses", cmd_cache)
    sp.add_argument("action", choices=["stats", "gc"])
    sp.add_argument("out", help="output folder of `modalign run`")
    sp.add_argument("--dry-run", action="store_true", help="gc: report what would be removed, remove nothing")

    lp = sub.add_parser("lineage", help="compliance queries over the committed lineage of an output folder",
                        description="compliance queries over the committed lineage of an output folder "
                                    "(read-only; DuckDB over the committed Parquet files)")
    lsub = lp.add_subparsers(dest="lineage_command", required=True)
    sp = lsub.add_parser("trace", help="where one output came from: source, operators, policy, removals, clock, model",
                         description="where one output came from: source URI and version, session and run, operator "
                                     "chain, de-identification policy and what was removed, clock mapping, model id",
                         epilog=f"ID: a feature id (digits), SESSION:TICK (a timeline row), SESSION/SOURCE/KIND/INDEX "
                                f"(an event id) or an output file (relative to OUT or absolute inside it). "
                                f"example: {EXAMPLES['lineage trace']}")
    sp.set_defaults(fn=cmd_lineage_trace)
    sp.add_argument("out", help="output folder of `modalign run`")
    sp.add_argument("id", help="feature id | SESSION:TICK | event id | output file")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp = lsub.add_parser("access", help="GDPR Art. 15: everything held that derives from one data subject",
                         description="GDPR Art. 15: every source, event, timeline row, CTAL row, feature, cache entry, "
                                     "FAISS id and pseudonym linked to a data subject, and how each was de-identified",
                         epilog=f"example: {EXAMPLES['lineage access']}")
    sp.set_defaults(fn=cmd_lineage_access)
    sp.add_argument("out", help="output folder of `modalign run`")
    sp.add_argument("--subject", required=True, help="data-subject id as the manifest lists it (never a name)")
    sp.add_argument("--format", choices=["text", "json", "html"], default="text",
                    help="text: a summary (default); json: every row, for machines; html: a self-contained page")
    sp.add_argument("--out", dest="report", metavar="FILE", help="write the report to FILE (outside OUT) instead "
                                                                 "of printing it")
    sp.add_argument("--json", action="store_true", help="same as --format json")
    sp.add_argument("--key-store", help="key store folder (outside OUT) with the pseudonym keys; default "
                                        "$MODALIGN_KEY_STORE or ~/.modalign/keys")
    sp.add_argument("--registry", metavar="FILE", help="subject registry (outside OUT; default subjects.yaml in the "
                                                       "key store, when it exists): also find documents of any "
                                                       "session that mention S, by S's keyed pseudonyms")
    sp = lsub.add_parser("erase", help="GDPR Art. 17: remove every row derived from a data subject or a source",
                         description="GDPR Art. 17: physically remove every row derived from a data subject's or one "
                                     "source's recordings (events, timeline, CTAL, features, quarantine and lineage "
                                     "rows, cache entries, FAISS vectors) in one commit, denylist them against "
                                     "re-ingest, and write a signed report (OUT/lineage/erasure/ID.json); see "
                                     "runbooks/erasure.md",
                         epilog=f"example: {EXAMPLES['lineage erase']}")
    sp.set_defaults(fn=cmd_lineage_erase)
    _display_options(sp)
    sp.add_argument("out", help="output folder of `modalign run`")
    who = sp.add_mutually_exclusive_group(required=True)
    who.add_argument("--subject", help="data-subject id as the manifest lists it (never a name)")
    who.add_argument("--source", help="source URI as `lineage trace` shows it (or its local path)")
    sp.add_argument("--scope", choices=["source", "session"], default="source",
                    help="--subject: remove every source whose lineage lists S (source, default), or every source of "
                         "each session one of whose sources lists S (session)")
    sp.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    sp.add_argument("--key-store", help="key store folder (outside OUT) with the denylist and signing keys; "
                                        "default $MODALIGN_KEY_STORE or ~/.modalign/keys")
    sp.add_argument("--registry", metavar="FILE", help="subject registry (outside OUT; default subjects.yaml in the "
                                                       "key store, when it exists): also find documents of any "
                                                       "session that mention S, by S's keyed pseudonyms")
    sp.add_argument("--keep-mentions", action="store_true",
                    help="with a registry: leave the documents of other sessions that merely mention S (they are "
                         "erased whole by default)")
    sp.add_argument("--json", action="store_true", help="machine-readable output (the report)")
    sp = lsub.add_parser("verify", help="check a signed erasure report against the output folder",
                         description="check an erasure report: its signature, its remaining files against the "
                                     "current commit (or what changed since), that no removed file is back, and "
                                     "that the access query for the erased sources (and subject) is empty; exit 1 "
                                     "when any check fails",
                         epilog=f"example: {EXAMPLES['lineage verify']}")
    sp.set_defaults(fn=cmd_lineage_verify)
    sp.add_argument("report", help="the erasure report (OUT/lineage/erasure/ID.json, or a copy)")
    sp.add_argument("--out", help="the output folder (default: the one the report lies in, else the one it names)")
    sp.add_argument("--subject", help="also re-run `lineage access --subject S` (the report names S only keyed)")
    sp.add_argument("--key-store", help="key store folder the erasure used (default $MODALIGN_KEY_STORE or "
                                        "~/.modalign/keys)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    return p


class _JsonLogFormatter(logging.Formatter):
    """``--log-format json``: a log record as one JSON line, like the display's messages."""

    def format(self, record: logging.LogRecord) -> str:
        from modalign.pipeline.progress import json_line

        return json_line("log", level=record.levelname.lower(), logger=record.name, message=record.getMessage())


def main(argv: list[str] | None = None) -> int:
    from modalign.pipeline.progress import make_display

    args = build_parser().parse_args(argv)
    log_format = getattr(args, "log_format", "text")
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonLogFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[handler])
    if log_format == "json":  # a record of a logger without handlers (Ray's, once ray.init removed them): JSON too
        logging.lastResort = logging.StreamHandler()
        logging.lastResort.setLevel(logging.WARNING)
        logging.lastResort.setFormatter(_JsonLogFormatter())
    args.display = make_display(quiet=getattr(args, "quiet", False), log_format=log_format)
    try:
        return args.fn(args)
    except ModalignError as exc:
        args.display.close()
        args.display.message(f"error: {exc}", "error")
        return 1


if __name__ == "__main__":
    sys.exit(main())
