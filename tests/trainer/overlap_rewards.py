"""A reward that tells the test's judge server when the async worker scores its second batch
(``overlap_rewards:release_on_second_batch``, imported by the worker via PYTHONPATH): the
server holds the first batch's judge requests until then, so the run finishes only if
judging batch 1 overlaps generating batch 2."""

import os
import urllib.request

_calls = [0]


def release_on_second_batch(prompts, completions, **columns):
    _calls[0] += 1
    if _calls[0] == 2:
        request = urllib.request.Request(os.environ["JUDGE_RELEASE_URL"], data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            reply.read()
    return [0.0] * len(completions)
