"""Generative judges (issue 50): the endpoint and parse rules, the request a judge sends,
the rate limit, and every way a judge fails (down, slow, nonsense) as one reward failure
naming the judge's URL and the sample, with the batch's threads joined. The command-line
runs are in test_model_rewards_cli.py."""

from __future__ import annotations

import threading
import time

import pytest

from judge_server import JudgeServer
from portarl.assets.data import Example
from portarl.assets.judges import RateLimiter, endpoint, first_number, last_number
from portarl.assets.reward_runner import RewardError, RewardRunner
from portarl.runtime.errors import ConfigError
from portarl.trainer.config import TrainConfig

ROWS = [Example("1+1=", "2", {"answer": "2"}, "d.jsonl:1"),
        Example(({"role": "user", "content": "2+2?"},), "4", {}, "d.jsonl:2")]
TEXTS = ["2", "3 it is", "4", "five"]


def _rows():
    return [ROWS[i // 2] for i in range(len(TEXTS))]


def _runner(url: str, extra: str = "", *more: str) -> RewardRunner:
    specs = ", ".join([f"{{judge: '{url}', model: tiny-judge{extra}}}", *more])
    return RewardRunner(TrainConfig.load(None, [f"rewards=[{specs}]"]).rewards)


def test_endpoint_and_parse_rules():
    assert endpoint("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert endpoint("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert endpoint("https://h/api/chat/completions") == "https://h/api/chat/completions"
    assert first_number("Score: 7/10, maybe -2.5e1") == 7.0
    assert last_number("Score: 7/10, maybe -2.5e1") == -25.0
    assert first_number("no digits") is None


def test_a_judge_scores_each_sample_with_its_template(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text('{"q": "{prompt}", "a": "{completion}", "ref": "{answer}"}')
    with JudgeServer() as server:
        runner = _runner(server.url, f", prompt: '{template}', name: j, weight: 2.0, max_tokens: 5", "{name: math_exact}")
        try:
            scores = runner.score(_rows(), TEXTS)
        finally:
            runner.close()
    sent = sorted(r["messages"][0]["content"] for r in server.requests)
    assert sent == sorted(['{"q": "1+1=", "a": "2", "ref": "2"}', '{"q": "1+1=", "a": "3 it is", "ref": "2"}',
                           '{"q": "user: 2+2?", "a": "4", "ref": "4"}', '{"q": "user: 2+2?", "a": "five", "ref": "4"}'])
    assert {r["path"] for r in server.requests} == {"/v1/chat/completions"}
    assert {r["model"] for r in server.requests} == {"tiny-judge"}
    assert {(r["temperature"], r["max_tokens"]) for r in server.requests} == {(0, 5)}
    want = [float(sum(map(ord, '{"q": "%s", "a": "%s", "ref": "%s"}' % (q, a, ref))) % 7)
            for q, a, ref in [("1+1=", "2", "2"), ("1+1=", "3 it is", "2"), ("user: 2+2?", "4", "4"),
                              ("user: 2+2?", "five", "4")]]
    assert scores.per_function["j"] == want
    assert scores.total.tolist() == pytest.approx([2 * w + m for w, m in zip(want, scores.per_function["math_exact"])])
    assert scores.metrics["reward/j"] == pytest.approx(sum(want) / 4)


def reply_length(reply: str) -> float:
    return float(len(reply))


def test_a_parse_function_reads_the_reply(monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    with JudgeServer() as server:
        runner = _runner(server.url, ", parse: 'test_judges:reply_length'")
        try:
            values = runner.score(_rows(), TEXTS).per_function["judge_tiny-judge"]
        finally:
            runner.close()
    assert values == [float(len("Score: 0"))] * 4  # "Score: <digit>"


@pytest.mark.parametrize("fault, settings, problem", [
    ("garbage", "", "answered something that is not a chat completion ('<html>502 oops</html>')"),
    ("words", "", "answered 'I cannot rate this.': no score in it"),
    ("slow", ", timeout_s: 0.2, retries: 1", "did not answer within 0.2 s (2 tries"),
    ("stop", ", retries: 1", "is unreachable"),
], ids=["garbage", "words", "slow", "stop"])
def test_a_failing_judge_is_one_reward_failure_naming_its_url_and_the_sample(fault, settings, problem):
    before = set(threading.enumerate())
    with JudgeServer(fault, after=1) as server:
        runner = _runner(server.url, settings)
        try:
            with pytest.raises(RewardError) as err:
                runner.score(_rows(), TEXTS)
        finally:
            runner.close()
        message = str(err.value)
        assert message.startswith(f"reward 'judge_tiny-judge' judge {server.url}/v1/chat/completions {problem}"), message
        assert " on sample " in message and "(prompt '" in message and "\n" not in message
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]  # every thread joined


def test_a_missing_template_or_one_without_the_completion_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\[0\].prompt must be a text file"):
        TrainConfig.load(None, [f"rewards=[{{judge: 'http://h:1', model: m, prompt: '{tmp_path / 'none.txt'}'}}]"])
    template = tmp_path / "t.txt"
    template.write_text("Rate {prompt}")
    with pytest.raises(ConfigError, match=r"rewards\[0\].prompt: .* does not contain \{completion\}"):
        _runner("http://h:1", f", prompt: '{template}'")


def test_a_relative_template_in_a_config_file_is_the_files(tmp_path, monkeypatch):
    (tmp_path / "judge.txt").write_text("{completion}")
    (tmp_path / "run.yaml").write_text("rewards: [{judge: 'http://h:1', model: m, prompt: judge.txt}]\n")
    monkeypatch.chdir(tmp_path.parent)
    assert TrainConfig.load(tmp_path / "run.yaml").rewards[0].prompt == str((tmp_path / "judge.txt").resolve())


def test_the_rate_limit_spaces_the_starts():
    limiter = RateLimiter(50.0, threading.Event())
    starts = []

    def start():
        limiter.wait()
        starts.append(time.monotonic())

    threads = [threading.Thread(target=start) for _ in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the k-th start is at least k / 50 s after the first could be, however loaded the machine
    assert all(t >= t0 + k * 0.02 - 1e-3 for k, t in enumerate(sorted(starts)))
