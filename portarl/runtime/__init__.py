"""What every process of a run shares, below the models and the algorithms: how a run's
processes start, stop and say why, and the guard around user code.

- stopping and saying why: :mod:`.supervisor` (the command's parent, which names a death),
  :mod:`.blackbox` (what a process is doing, read after it died), :mod:`.continuation` (the
  command that continues a run), :mod:`.startup_signals`, :mod:`.exit_path` (how a torchrun
  rank leaves);
- child processes: :mod:`.lifeline` (a child dies with its parent), :mod:`.process_tree`
  (a process ended with everything it started);
- user code: :mod:`.user_code` (the one guarded way into rewards, hooks, tools, environments);
- several ranks: :mod:`.distributed` (torchrun, FSDP2, collectives), :mod:`.heartbeat`
  (a silent rank is named);
- files: :mod:`.fileperms`; errors raised on more than one layer: :mod:`.errors`.
"""
