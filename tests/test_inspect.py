"""`vllm-mtp inspect`: a checkpoint's MTP layers from its headers, and the problems it finds."""

import shutil

from safetensors.torch import load_file, save_file

from vllm_mtp_plugin.tools.inspect import inspect, main


def rewrite(source, target, keep):
    shutil.copytree(source, target)
    tensors = {k: v for k, v in load_file(str(source / "model.safetensors")).items() if keep(k)}
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_a_good_checkpoint(checkpoints, capsys):
    report = inspect(checkpoints("oracle", num_nextn_predict_layers=2))
    assert report["problems"] == []
    assert sorted(report["layers"]) == [2, 3]
    layer = report["layers"][2]
    assert layer["experts"] == 4
    assert layer["dtypes"] == {"F32": layer["tensors"]}
    assert layer["shared_with_target"] == ["model.layers.2.embed_tokens.weight",
                                           "model.layers.2.shared_head.head.weight"]
    assert layer["shared_bytes"] == 2 * 2048 * 256 * 4
    assert main([str(checkpoints("oracle"))]) == 0
    assert "OK: usable as an MTP drafter" in capsys.readouterr().out


def test_stripped_and_incomplete_checkpoints(checkpoints, tmp_path, capsys):
    oracle = checkpoints("oracle")
    stripped = rewrite(oracle, tmp_path / "stripped", lambda k: not k.startswith("model.layers.2."))
    assert inspect(stripped)["problems"] == [
        "MTP layer 2 has no tensors: the checkpoint may have been quantized or exported without "
        "its MTP layers"]
    no_hnorm = rewrite(oracle, tmp_path / "no-hnorm", lambda k: "hnorm" not in k)
    assert inspect(no_hnorm)["problems"] == ["MTP layer 2 lacks model.layers.2.hnorm.weight"]
    assert main([str(no_hnorm)]) == 1
    assert "PROBLEM: MTP layer 2 lacks model.layers.2.hnorm.weight" in capsys.readouterr().out
