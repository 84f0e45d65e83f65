"""Behaviour of tools/trajectories.py on steps saved as rl.py saves them: the page, no text can end
a script, arms side by side, a large step's cut, refusals; TensorBoard's samples; Chromium."""
import gzip
import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from rl_runs import PYTHON, REPO
from machinery.config import ConfigError
from machinery.metrics import MetricsLogger
from machinery.saved_rollouts import read_rollouts, step_dir
from tools.trajectories import parse, write_page

CONFIG = {"algorithm": "roc", "positive_rule": "sample", "group_size": 4, "prompts_per_step": 2,
          "filter_all_equal": True, "roc_error_ratio": True, "roc_answer_format": True}
HOSTILE = "</script><script>window.owned = 1</script><img src=x onerror=alert(1)> <!-- &amp;"


def trajectory(position, sample, reward, selected, text="x = 6 * 7", tool_errors=0):
    calls = [{"code": "print(6 * 7)", "stdin": "", "status": "error" if tool_errors else "ok",
              "output": "<tool_response>42</tool_response>"}]
    return {"step": 1, "position": position, "id": f"p{position}", "problem_text": "Compute 6*7.",
            "answer": "42", "reward": reward, "penalty": float(tool_errors), "selected": selected,
            "advantage": (1.0 if reward else -1.0) if selected else None,
            "response_tokens": 10 + sample, "sample_index": sample, "problem_index": position,
            "response_text": text, "model_text": f"{text} \\boxed{{{42 if reward else 41}}}",
            "tool_calls": calls, "num_tool_calls": 1, "num_tool_errors": tool_errors,
            "tool_errors_by_kind": {"error": tool_errors, "timeout": 0}, "num_answer_tags": 1,
            "num_turns": 2, "stop_reason": "end_of_turn", "truncated": False,
            "prompt_ids": [1, 2], "response_ids": [3] * 10, "loss_mask": [1] * 10,
            "logprobs": [-0.5] * 10}


def save_step(run_dir, step, groups, config=CONFIG, ranks=1):
    """groups: lists of trajectory records, dealt to `ranks` rank files whole, as rl.py does."""
    folder = step_dir(run_dir, step)
    folder.mkdir(parents=True)
    for rank in range(ranks):
        with gzip.open(folder / f"rank_{rank:05d}.jsonl.gz", "wt") as f:
            for group in groups[rank::ranks]:
                f.writelines(json.dumps(r) + "\n" for r in group)
    (folder / "step.json").write_text(json.dumps({
        "step": step, "ranks": ranks, "data_position": 0,
        "rollouts_per_prompt": 2 * config["group_size"], "config": config}))


# group 0: 5 correct (1 with a failed call), 3 wrong; RoC kept 2 + 2. group 1: all wrong.
MIXED = [trajectory(0, i, float(i < 5), i in (0, 2, 5, 6), tool_errors=int(i == 1),
                    text=HOSTILE if i == 3 else "x = 6 * 7") for i in range(8)]
ALL_WRONG = [trajectory(1, i, 0.0, False) for i in range(8)]


class Elements(HTMLParser):
    """The page as a browser's tokenizer splits it: every element's tag and attributes, and the
    text inside each script."""

    def __init__(self, page):
        super().__init__()
        self.tags, self.scripts, self.inside = [], [], False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.inside = dict(attrs).get("id") if tag == "script" else False

    def handle_endtag(self, tag):
        self.inside = False

    def handle_data(self, data):
        if self.inside is not False:  # the script's id, None for the template's own
            self.scripts.append((self.inside, data))


def written(tmp_path, *args):
    out, _ = write_page(parse([*args, f"out={tmp_path / 'page.html'}"]))
    return Elements(out.read_text())


def test_the_page_holds_every_trajectory_its_selection_and_the_rules_reasons(tmp_path):
    run = tmp_path / "run"
    save_step(run, 1, [MIXED, ALL_WRONG])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "accuracy": 0.3125, "loss": 0.1}))
    page = written(tmp_path, str(run))
    blocks = dict(page.scripts)
    assert list(blocks) == ["index", "g1_0", "g1_1", None]  # None: the template's own script
    index = json.loads(blocks["index"])
    step = index["steps"][0]
    assert step["runs"][0]["metrics"]["accuracy"] == 0.3125 and "cut" not in step
    assert [g["cells"][0]["kept"] for g in step["groups"]] == [4, 0]
    [group] = json.loads(blocks["g1_0"])
    assert [t["selected"] for t in group] == [r["selected"] for r in MIXED]
    assert group[3]["response_text"] == HOSTILE  # read back unchanged
    assert group[1]["split"] == [1.0, 0.0] and group[1]["errors_by_kind"] == {"error": 1}
    assert [t["answer_read"] for t in group] == ["42"] * 5 + ["41"] * 3
    assert group[0]["reason"].startswith("positive: 2 of 5 positives kept")
    assert group[7]["reason"] == "negative: 2 of 3 negatives kept, drawn uniformly"
    assert "all equal" in json.loads(blocks["g1_1"])[0][0]["reason"]


def test_no_trajectory_text_can_end_a_script_or_add_markup(tmp_path):
    save_step(tmp_path / "run", 1, [MIXED])
    page = written(tmp_path, str(tmp_path / "run"))
    # the tokenizer sees the template's elements only: no <img>, no script beyond the blocks
    assert [tag for tag, _ in page.tags if tag in ("img", "script")] == ["script"] * 3
    assert all(s[1].count("<") == 0 for s in page.scripts if s[0])


def test_arms_side_by_side_and_a_large_step_cut_with_a_note(tmp_path):
    save_step(tmp_path / "roc", 1, [MIXED, ALL_WRONG], ranks=2)
    save_step(tmp_path / "grpo", 1, [[dict(t, selected=True) for t in MIXED]],
              config={**CONFIG, "algorithm": "grpo"})
    page = dict(written(tmp_path, str(tmp_path / "roc"), str(tmp_path / "grpo")).scripts)
    roc, grpo = json.loads(page["g1_0"])
    assert len(roc) == len(grpo) == 8 and grpo[0]["reason"] == "grpo: all 8 of the group kept"
    assert json.loads(page["g1_1"])[1] is None  # the grpo run has no position 1
    cut = dict(written(tmp_path, str(tmp_path / "roc"), "groups=1").scripts)
    assert "g1_1" not in cut and "1 of 2 groups" in json.loads(cut["index"])["steps"][0]["cut"]


@pytest.mark.parametrize("damage, named", [
    ("no rollouts", "rollouts"), ("step=7", "step=7"),
    ("torn", "rank_00000.jsonl.gz"), ("missing rank", "rank_00001.jsonl.gz")])
def test_bad_input_is_refused_naming_the_path(tmp_path, damage, named):
    run = tmp_path / "run"
    run.mkdir()
    args = [str(run), damage] if damage.startswith("step=") else [str(run)]
    if damage != "no rollouts":
        save_step(run, 1, [MIXED, ALL_WRONG], ranks=2)
        first = step_dir(run, 1) / "rank_00000.jsonl.gz"
        if damage == "torn":
            first.write_bytes(first.read_bytes()[:-20])
        if damage == "missing rank":
            (step_dir(run, 1) / "rank_00001.jsonl.gz").unlink()
    with pytest.raises(ConfigError, match=named):
        write_page(parse([*args, "groups=0"]))


def test_the_command_line_refuses_in_one_line_with_a_nonzero_exit(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "tools.trajectories", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"{tmp_path}/rollouts" in proc.stderr


def test_tensorboard_shows_a_steps_samples_with_their_fields_and_whole_text(tmp_path):
    """log_samples beside the curves: TensorBoard's text tab gets each trajectory's fields and its
    text, read back from the event file (W&B's table holds the same rows)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log_samples(3, MIXED[:2] + MIXED[3:4])
    logger.close()
    events = accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    [event] = events.Reload().Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and text.count("sample_index") == 3
    assert "errors_by_kind error 1" in text and "\n    </script><script>" in text


@pytest.mark.slow
def test_the_page_of_a_real_run_works_in_headless_chromium(saved_run, tmp_path):
    """.ci/browser: the page of a real 2-step run in Debian's chromium, driven by Selenium through
    the system's chromedriver (nothing downloaded): no console error; a group opens to its 2G
    trajectories marked as saved; a filter hides the kept; a tool output expands."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("no chromium and chromedriver: .ci/browser installs Debian's")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options, webdriver.ChromeService(shutil.which("chromedriver")))
    by = pytest.importorskip("selenium.webdriver.common.by").By
    select = pytest.importorskip("selenium.webdriver.support.select").Select
    try:
        out, _ = write_page(parse([str(saved_run.dir), "step=1", f"out={tmp_path / 'run.html'}"]))
        driver.get(out.as_uri())
        _, meta, records = read_rollouts(saved_run.dir, 1)
        saved = [r for r in records if r["position"] == min(r["position"] for r in records)]
        group = driver.find_element(by.CSS_SELECTOR, "details.group")
        group.find_element(by.TAG_NAME, "summary").click()
        cards = group.find_elements(by.CSS_SELECTOR, ".traj")
        assert len(cards) == meta["rollouts_per_prompt"] == len(saved)
        assert [c.find_element(by.CLASS_NAME, "mark").text for c in cards] == [
            "kept" if r["selected"] else "dropped" for r in saved]
        select(driver.find_element(by.ID, "show")).select_by_value("dropped")
        assert [c.is_displayed() for c in cards] == [not r["selected"] for r in saved]
        select(driver.find_element(by.ID, "show")).select_by_value("all")
        call = driver.find_element(by.CSS_SELECTOR, "details.call")
        output = call.find_element(by.CSS_SELECTOR, "pre.output")
        assert not output.is_displayed()
        call.find_element(by.TAG_NAME, "summary").click()
        assert output.is_displayed() and output.text.strip()
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        driver.quit()
