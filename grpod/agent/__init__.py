"""`grpod agent`: engines on other nodes, supervised there, serving the leader.

- `api`: the agent's HTTP API as data (routes, the launch request) and `AgentClient`, the
  leader's client of it;
- `hosted`: `HostedEngine`, one engine an agent supervises for the leader (launch, stop, its
  own relaunch of a crashed engine, the wait for a launch's end);
- `server`: the aiohttp application (bearer token on every route) and `run_agent`, the daemon;
- `remote`: `RemoteInference`, the leader's engine object for an engine an agent runs, used by
  the bridges and the `Policy` exactly like a local `SupervisedInference`.
"""
