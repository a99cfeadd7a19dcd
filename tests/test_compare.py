"""experiments.compare: a re-run's medians against a reference run's, within a tolerance."""
from experiments.compare import main
from experiments.records import RecordWriter, unavailable


def write_run(directory, tpots: dict) -> None:
    """records.csv with one row per value: tpots maps (system, dataset) -> TPOTs of its cases."""
    directory.mkdir()
    writer = RecordWriter(directory)
    for (system, dataset), values in tpots.items():
        for case, tpot in enumerate(values):
            writer.add({"system": system, "dataset": dataset, "prompt_id": case // 3, "repeat": case % 3, "k": 8,
                        "prefix_tokens": 16, "batch_size": "", "status": "ok", "tpot_ms": tpot})
    writer.add(unavailable({"system": "vllm", "dataset": "*", "prompt_id": -1, "repeat": "", "k": 8,
                            "prefix_tokens": 16, "batch_size": ""}, "not installed"))


def test_medians_within_the_tolerance_pass_and_one_outside_fails(tmp_path, capsys):
    write_run(tmp_path / "ref", {("specter", "gsm8k"): [10.0, 11.0, 12.0], ("target_only", "gsm8k"): [50.0],
                                 ("mo_sm", "gsm8k"): [70.0]})
    write_run(tmp_path / "new", {("specter", "gsm8k"): [11.5, 12.0, 12.5], ("target_only", "gsm8k"): [60.0]})
    assert main([str(tmp_path / "ref"), str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert "2 of 4 medians within 10% of the reference" in out  # specter gsm8k and ALL; target_only twice out
    assert "target_only/gsm8k (1.20x)" in out and "mo_sm" not in out and "vllm" not in out
    assert main([str(tmp_path / "ref"), str(tmp_path / "new"), "--tolerance", "0.25"]) == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    write_run(tmp_path / "ref", {("specter", "gsm8k"): [10.0]})
    for args, message in [([str(tmp_path / "missing"), str(tmp_path / "ref")], "not a results directory"),
                          ([str(tmp_path / "ref"), str(tmp_path / "ref"), "--tolerance", "-1"], "--tolerance"),
                          ([str(tmp_path / "ref"), str(tmp_path / "ref"), "--metric", "nope"], "no column")]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_runs_of_another_setup_are_compared_with_a_warning(tmp_path, capsys):
    import json

    for name, mem in (("ref", "high"), ("new", "low")):
        write_run(tmp_path / name, {("specter", "gsm8k"): [10.0]})
        config = {"model": {"name": "dsv2", "weights": "calibrated"}, "mem": {"name": mem}, "dtype": "auto"}
        (tmp_path / name / "run.json").write_text(json.dumps({"config": config}))
    assert main([str(tmp_path / "ref"), str(tmp_path / "new")]) == 0
    err = capsys.readouterr().err
    assert "differ in setup (mem.name: high -> low)" in err and "model.name" not in err


def test_hosts_of_another_speed_are_named(tmp_path, capsys):
    import json

    for name, op_us in (("ref", 4.0), ("new", 6.0), ("same", 4.2)):
        write_run(tmp_path / name, {("specter", "gsm8k"): [10.0]})
        (tmp_path / name / "run.json").write_text(json.dumps({"config": {}, "machine": {"host_op_us": op_us}}))
    assert main([str(tmp_path / "ref"), str(tmp_path / "new")]) == 0
    err = capsys.readouterr().err
    assert "hosts differ in speed (host_op_us 4.0 -> 6.0, 1.50x)" in err and "differ in setup" not in err
    assert main([str(tmp_path / "ref"), str(tmp_path / "same")]) == 0
    assert "hosts differ" not in capsys.readouterr().err


def test_a_partial_rerun_is_compared_over_the_prompts_both_measured(tmp_path, capsys):
    """The reference has prompts 0 and 1 (3 repeats each), the re-run prompt 0 only: prompt 1's rows (twice as
    slow) stay out of the reference's median unless --all-cases asks for every case."""
    write_run(tmp_path / "ref", {("specter", "gsm8k"): [10.0, 10.0, 10.0, 20.0, 20.0, 20.0]})
    write_run(tmp_path / "new", {("specter", "gsm8k"): [10.5, 10.5]})
    assert main([str(tmp_path / "ref"), str(tmp_path / "new")]) == 0
    captured = capsys.readouterr()
    assert "2 of 2 medians within 10%" in captured.out
    assert "note: 3 measured rows are cases only one run has" in captured.err
    assert main([str(tmp_path / "ref"), str(tmp_path / "new"), "--all-cases"]) == 1  # median 15 against 10.5
    captured = capsys.readouterr()
    assert "specter/gsm8k (0.70x)" in captured.out and "note:" not in captured.err


def test_ratios_between_systems_are_each_runs_own_never_pooled(tmp_path, capsys):
    write_run(tmp_path / "ref", {("specter", "gsm8k"): [10.0, 10.0, 10.0], ("mo_sm", "gsm8k"): [40.0, 40.0, 40.0]})
    write_run(tmp_path / "new", {("specter", "gsm8k"): [20.0, 20.0, 20.0], ("mo_sm", "gsm8k"): [60.0, 60.0, 60.0]})
    main([str(tmp_path / "ref"), str(tmp_path / "new"), "--tolerance", "2"])
    out = capsys.readouterr().out.split("x Specter within each run")[1]
    mo_sm = next(line for line in out.splitlines() if line.strip().startswith("mo_sm")).split()
    assert mo_sm[1:] == ["4.000", "3.000", "3.00-4.00x"]  # 40/10 and 60/20; never 60/10 or a pooled 50/15
