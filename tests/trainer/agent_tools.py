"""Tools and environments for the multi-turn tests: stdlib only, so the tool process of
``rollout.tool_isolation: process`` starts in a fraction of a second."""

from __future__ import annotations

import os
import subprocess
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b  # b = 0 raises ZeroDivisionError: the model must get it as a message


def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)  # past rollout.tool_timeout_s: a hung tool
    return "woke"


def leave() -> str:
    """Call sys.exit(3)."""
    raise SystemExit(3)


def pid() -> int:
    """The id of the process the tool runs in."""
    return os.getpid()


def crash() -> str:
    """Take the interpreter down (a segfaulting C extension, say)."""
    os._exit(3)


def spawn(path: str) -> list:
    """Start three `sleep 1000` that outlive the call: a child, one in a session of its own
    (setsid: another process group too) and one a shell leaves behind (a daemon's double
    fork: its parent is gone); append their pids to a file.

    Args:
        path: The file the pids are appended to, one a line.
    """
    return spawn_sleepers(path)


def spawn_sleepers(path) -> list[int]:
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    child = subprocess.Popen(["sleep", "1000"], **quiet)
    session = subprocess.Popen(["sleep", "1000"], start_new_session=True, **quiet)
    shell = subprocess.run(["sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True,
                           text=True, check=True)
    pids = [child.pid, session.pid, int(shell.stdout)]
    with open(path, "a") as f:
        f.write("".join(f"{pid}\n" for pid in pids))
    return pids


def reward_env_text(prompts, completions, conversation, **columns):
    """A batched reward that reads the conversation column (multi-turn episodes add it)."""
    return [float(sum(m["role"] == "assistant" for m in conv)) for conv in conversation]


def reward_final_length(prompts, completions, **columns):
    """A batched reward with spread even for an untrained model (advantages and gradients
    not 0): the final turn's length modulo 3 (a conversational prompt's completion is
    ``[{"role": "assistant", "content": text}]``)."""
    return [float(len(c[-1]["content"] if isinstance(c, list) else c) % 3) for c in completions]


class CountEnv:
    """Answers every reply with "again" until the third, then is done; reward: replies seen."""

    def reset(self, row):
        self.replies = 0
        return None

    def step(self, message):
        self.replies += 1
        if self.replies >= 3:
            return {"observation": None, "done": True, "reward": float(self.replies)}
        return "again"


class BrokenEnv(CountEnv):
    def step(self, message):
        raise RuntimeError("the environment broke")


class GreetEnv:
    """Adds "Say hello." to the prompt; done after one reply, reward 1 if it said hello."""

    def reset(self, row):
        return "Say hello."

    def step(self, message):
        self.said = message
        return None

    def get_reward(self):
        return 1.0 if "hello" in self.said else 0.0


class PidEnv:
    """Tells the model which process it runs in (the async worker's, not the trainer's)."""

    def reset(self, row):
        return None

    def step(self, message):
        return {"observation": f"pid {os.getpid()}", "done": False, "reward": 1.0}


class SpawnEnv(CountEnv):
    """CountEnv whose reset starts :func:`spawn`'s three sleepers (pids appended to the file
    named by $PORTARL_TEST_SPAWNED)."""

    def reset(self, row):
        spawn_sleepers(os.environ["PORTARL_TEST_SPAWNED"])
        return super().reset(row)


class LongResetEnv(CountEnv):
    """Appends more text to the prompt than the model's context holds."""

    def reset(self, row):
        super().reset(row)
        return "x" * 5000


class RankEnv:
    """Answers each reply with this process's torchrun rank and pid; done after
    ``1 + 2 * rank`` replies (rank 0: one turn, rank 1: three), so the ranks of one
    tensor-parallel group play different numbers of turns and append different text on
    purpose. Reward: replies seen."""

    def reset(self, row):
        self.replies = 0
        return None

    def step(self, message):
        self.replies += 1
        rank = int(os.environ["RANK"])
        if self.replies >= 1 + 2 * rank:
            return {"observation": None, "done": True, "reward": float(self.replies)}
        return f"rank {rank} pid {os.getpid()}"


class JudgeEnv:
    """Done at the first reply, with a verdict the model never reads (its episode is over)."""

    def reset(self, row):
        return "Answer in one word."

    def step(self, message):
        return {"observation": "Verdict: fine.", "done": True, "reward": 1.0}


#: Ten megabytes of text: a tool that dumps a file or a web page whole.
FLOOD = "START " + "lorem ipsum dolor " * (10_000_000 // 18) + " END"


def flood() -> str:
    """Return ten megabytes of text."""
    return FLOOD


def echo(n: int) -> str:
    """Return n characters.

    Args:
        n: How many.
    """
    return "y" * n


class FloodEnv(CountEnv):
    """Ten megabytes of reset text, and of each observation until CountEnv is done."""

    def reset(self, row):
        super().reset(row)
        return FLOOD

    def step(self, message):
        out = super().step(message)
        return FLOOD if isinstance(out, str) else out
