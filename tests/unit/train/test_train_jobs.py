"""``vllm-mtp train``'s jobs are dataclasses, JSON only in the file another process reads, which
refuses a bad field by name; the trained layer is renamed once, from the trainer's modules to the
checkpoint's names, and keeps those through the work directory to the export."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_mtp_plugin.tools.tiny import trained
from vllm_mtp_plugin.tools.state_collection import CollectJob, CollectSettings
from vllm_mtp_plugin.tools.train.export import LAYER_SHARD, export
from vllm_mtp_plugin.tools.job_files import JobError, job_to_json, read_job, write_job
from vllm_mtp_plugin.tools.mtp_layer.trainable import MtpTrainModel
from vllm_mtp_plugin.tools.train.run import LAYERS_FILE, TrainJob, trained_layers
from vllm_mtp_plugin.tools.mtp_layer.v3_target import open_target
from vllm_mtp_plugin.tools.train.trainer import TrainSettings, trained_tensors

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


def test_the_trained_layer_keeps_the_checkpoints_names_from_the_trainer_to_the_export(tmp_path):
    """Modules (the trainer's, ``{j}.<module>``) -> the checkpoint's names, once; the work
    directory's file and the export keep them."""
    full = trained.write_checkpoint(tmp_path / "full", 1)
    target = open_target(full)
    layer = f"model.layers.{target.num_hidden_layers}."
    stored = {n for n in target.tensors if n.startswith(layer)}
    model = MtpTrainModel(target, "checkpoint", 1, "chained")
    modules = set(model.layers.state_dict())
    assert "0.mtp_block.mlp.experts.gate_up_proj" in modules and "0.post_norm.weight" in modules
    named = trained_tensors(model)  # what the trainer hands on
    shared = {layer + "embed_tokens.weight", layer + "shared_head.head.weight"}
    assert set(named) == stored - shared
    assert set(model.checkpoint_tensors()) == set(named)
    save_file({n: t.contiguous() for n, t in named.items()}, str(tmp_path / "layers.safetensors"))
    assert set(load_file(str(tmp_path / "layers.safetensors"))) == set(named)
    summary = export(target, named, tmp_path / "out")
    assert summary["mtp_layers"] == 1
    with safe_open(str(tmp_path / "out" / LAYER_SHARD), "pt") as f:
        assert set(f.keys()) == stored  # the checkpoint's own names, the shared copies added
        assert torch.equal(f.get_tensor(layer + "eh_proj.weight"),
                           named[layer + "eh_proj.weight"].to(target.dtype))


def test_chained_layers_are_numbered_after_the_target(tmp_path):
    full = trained.write_checkpoint(tmp_path / "full", 1)
    target = open_target(full)
    model = MtpTrainModel(target, "scratch", 2, "chained")
    base = target.num_hidden_layers
    named = model.checkpoint_tensors()
    assert {n.split(".")[2] for n in named} == {str(base), str(base + 1)}
    work = tmp_path / "work"
    work.mkdir()
    save_file({n: t.contiguous() for n, t in named.items()},
              str(work / LAYERS_FILE))
    assert set(trained_layers(work)) == set(named)
