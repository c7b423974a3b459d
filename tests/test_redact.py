"""Credentials stay where they are: storage options redacted in every form we show or keep.

Unit level, no Ray: the redaction rule, the config / read options / dataset reprs, error
messages and log records scrubbed, the sealed options of the job's Ray Train config (what Ray
Train's state API shows and exports of it, and that the workers still get the real values),
checkpoint state and metric tags. ``tests/test_secret_job.py`` runs a real job with a planted
secret and searches everything it wrote.
"""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import DatasetInfo
from ray_ingest.config import config_from_dict
from ray_ingest.errors import CatalogError, IngestError
from ray_ingest.redact import REDACTED, Sealed, redact_options, register, scrub
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_options,
)

SECRET = "ya29.PLANTED-unit-SECRET-0d5e"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIEvPLANTEDkey\n-----END PRIVATE KEY-----\n"
OPTIONS = {"token": SECRET, "password": "hunter2-PLANTED", "project": "my-project",
           "endpoint_url": "https://svc:pw-PLANTED@storage.example", "requester_pays": True,
           "requests_timeout": 30, "sa": {"private_key": KEY, "client_email": "a@b.iam"}}


def no_secret(text: str) -> None:
    for s in (SECRET, "MIIEvPLANTEDkey", "hunter2-PLANTED", "pw-PLANTED"):
        assert s not in text, text


def test_redaction_rule():
    got = redact_options(OPTIONS)
    assert got == {"token": REDACTED, "password": REDACTED, "project": "my-project",
                   "endpoint_url": "https://<redacted>@storage.example",
                   "requester_pays": True, "requests_timeout": 30,
                   "sa": {"private_key": REDACTED, "client_email": REDACTED}}
    # a gcsfs token *method* says where credentials come from; it is none itself
    assert redact_options({"token": "google_default"}) == {"token": "google_default"}
    assert redact_options({"token": "cloud", "key": "cloud"}) == {"token": "cloud",
                                                                  "key": REDACTED}
    assert redact_options(None) == {}


def test_config_read_options_and_dataset_info_reprs_are_redacted():
    cfg = config_from_dict({"data": {"paths": ["gs://b/ds"], "storage_options": OPTIONS}})
    assert cfg.data.storage_options == OPTIONS  # the real values are kept for use
    for text in (repr(cfg), str(cfg.data), repr(read_options(cfg)),
                 repr(ReadOptions(storage_options=OPTIONS)),
                 repr(DatasetInfo(["gs://b/ds"], object_store_config=OPTIONS))):
        no_secret(text)
        assert f"'token': '{REDACTED}'" in text, text


def test_errors_never_show_a_registered_secret_or_url_password():
    register(OPTIONS)
    err = CatalogError(f"gs://b/wdinfo.json: cannot read wdinfo.json (Bearer {SECRET} refused; "
                       f"key {KEY!r})")
    no_secret(str(err))
    no_secret(repr(err))
    assert "Bearer <redacted> refused" in str(err)
    url = IngestError("https://alice:s3cr3t-word@data.example/x.tar: read failed")
    assert str(url) == "https://<redacted>@data.example/x.tar: read failed"
    # short strings are not scrubbed from free text (they would hit ordinary words)
    register({"token": "abc"})
    assert str(IngestError("abc def")) == "abc def"
    assert scrub("nothing to hide") == "nothing to hide"


def test_log_records_are_scrubbed_whoever_logs(caplog):
    register(OPTIONS)
    log = logging.getLogger("some.library")
    with caplog.at_level(logging.INFO):
        log.warning("connecting with token %s to %s", SECRET, "https://u:pw-PLANTED@h/x")
        log.info("project my-project, endpoint http://127.0.0.1:9000")  # not secrets
        try:
            raise ValueError(f"bad credentials {SECRET}")
        except ValueError:
            log.exception("request failed")
    text = caplog.text
    no_secret(text)
    assert "pw-PLANTED" not in text
    assert f"token {REDACTED}" in text and f"bad credentials {REDACTED}" in text
    assert "project my-project, endpoint http://127.0.0.1:9000" in text


def test_sealed_options_show_nothing_and_carry_everything():
    sealed = Sealed(OPTIONS)
    no_secret(repr(sealed))
    no_secret(str(sealed))
    no_secret(json.dumps({"x": sealed}, default=str))
    back = pickle.loads(pickle.dumps(sealed))
    assert back.reveal() == OPTIONS
    from ray import cloudpickle

    assert cloudpickle.loads(cloudpickle.dumps(sealed)).reveal() == OPTIONS


def test_job_config_shows_no_secret_and_the_worker_gets_the_real_options():
    from ray_ingest.train.job import job_config
    from ray_ingest.train.worker import worker_config

    cfg = config_from_dict({"data": {"paths": ["gs://b/ds"], "storage_options": OPTIONS}})
    config = job_config(cfg, audit_dir="/tmp/ledger", quiet=True)
    no_secret(json.dumps(config, default=str))
    no_secret(repr(config))
    assert config["cfg"]["data"]["storage_options"]["token"] == REDACTED
    # what Ray Train's state API shows and exports of train_loop_config (at any depth)
    from ray.train.v2._internal.state.schema import _to_json_serializable_value

    no_secret(json.dumps(_to_json_serializable_value(config, max_depth=20)))
    # the workers rebuild the real config from what Ray pickles to them
    got = worker_config(pickle.loads(pickle.dumps(config)))
    assert got.data.storage_options == OPTIONS
    assert got == cfg
    # a config of before the sealed options still works
    assert worker_config({"cfg": cfg.to_dict()}) == cfg


def test_checkpoint_state_and_metric_tags_carry_no_storage_options(tmp_path):
    from ray_ingest.metrics import tags
    from ray_ingest.plan.state import initial_state
    from ray_ingest.plan.topology import Topology

    synth_dataset(str(tmp_path / "ds"), samples=8, shard_size=4, seed=0, min_side=16,
                  max_side=24)
    plain = load_catalog([str(tmp_path / "ds")])
    planted = load_catalog([str(tmp_path / "ds")], storage_options=OPTIONS)
    assert planted.fingerprint == plain.fingerprint  # the dataset tag of every metric
    no_secret(json.dumps(planted.fingerprint_doc()))
    no_secret(json.dumps(tags(0, 0, planted.fingerprint)))
    cfg = config_from_dict({"data": {"paths": [str(tmp_path / "ds")],
                                     "storage_options": OPTIONS}})
    state = initial_state(planted.fingerprint, cfg.loader.plan_params(), 0, Topology(1),
                          dataset=planted.fingerprint_doc(), batch_size=4)
    no_secret(json.dumps(state.to_dict()))


@pytest.mark.parametrize("options", [{}, {"token": "anon"}])
def test_nothing_registered_means_nothing_changed(options):
    register(options)
    assert scrub("plain text, token anon") == "plain text, token anon"
