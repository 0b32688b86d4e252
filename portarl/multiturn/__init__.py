"""Multi-turn rollouts: tool calls and stateful environments, trained on exactly the tokens
the model produced (docs/agents.md).

- :mod:`.tools`: ``module:function`` tools and their JSON schemas;
- :mod:`.environment`: the environment protocol (``reset(row)``, ``step(message)``);
- :mod:`.parsing`: tool calls in the chat template's format, malformed ones detected;
- :mod:`.render`: ids appended after a model turn, through the chat template;
- :mod:`.trajectory`: the token ids, the model-token mask, the behaviour log-probs, who wrote each run;
- :mod:`.episode`: the loop (generate, call, append) over a batch of episodes;
- :mod:`.calls`, :mod:`.operations`, :mod:`.sandbox`: every call into a tool or an
  environment, time-limited, in this process or a child one;
- :mod:`.leftovers`: the processes those calls start, ended at the run's end;
- :mod:`.report`: ``agent/*`` metrics, the tool-errors event, the sample log's records;
- :mod:`.agent`, :mod:`.settings`: built from and checked with the config.
"""
