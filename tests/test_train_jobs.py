"""``vllm-mtp train``'s jobs are dataclasses, JSON only in the file another process reads, which
refuses a bad field by name."""

import dataclasses
import json

import pytest

from vllm_mtp_plugin.tools.train.collect import CollectJob, CollectSettings
from vllm_mtp_plugin.tools.train.jobs import JobError, job_to_json, read_job, write_job
from vllm_mtp_plugin.tools.train.run import TrainJob
from vllm_mtp_plugin.tools.train.trainer import TrainSettings

TRAIN_JOB = TrainJob(target="/t", data_dir="/d", work_dir="/w",
                     settings=TrainSettings(steps=5, train_only=("eh_proj", "norms"), seed=3))


def test_a_train_job_round_trips_and_its_file_keeps_its_layout(tmp_path):
    path = write_job(TRAIN_JOB, tmp_path / "train.json")
    back = read_job(TrainJob, path)
    assert back == TRAIN_JOB and back.settings.train_only == ("eh_proj", "norms")
    # the layout the file has always had: the job's fields, the settings as an object
    assert json.loads(path.read_text()) == {
        "target": "/t", "data_dir": "/d", "work_dir": "/w",
        "settings": {**dataclasses.asdict(TRAIN_JOB.settings), "train_only": ["eh_proj", "norms"]}}


def test_a_collect_job_round_trips(tmp_path):
    job = CollectJob(model_dir="/m", prompts="/p", data_dir="/d",
                     settings=CollectSettings(temperature=0.0, record_outputs=True),
                     engine_kwargs={"max_model_len": 512})
    assert read_job(CollectJob, write_job(job, tmp_path / "collect.json")) == job


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(tagret="/t"), "'tagret'"),  # a misspelt field
    (lambda d: d.pop("work_dir"), "'work_dir' is missing"),
    (lambda d: d["settings"].update(steps="ten"), "'settings.steps': 'ten' is not"),
    (lambda d: d["settings"].update(learning_rate=True), "'settings.learning_rate'"),
    (lambda d: d["settings"].update(train_only=[1]), "'settings.train_only'"),
    (lambda d: d["settings"].update(warmup=3), "'settings.warmup'"),
    (lambda d: d.update(settings=[]), "settings must be a JSON object"),
])
def test_a_bad_job_field_is_refused_by_name(tmp_path, edit, field):
    data = job_to_json(TRAIN_JOB)
    edit(data)
    path = tmp_path / "train.json"
    path.write_text(json.dumps(data))
    with pytest.raises(JobError, match="train.json: .*" + field.replace("(", r"\(")):
        read_job(TrainJob, path)
