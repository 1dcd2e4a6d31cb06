"""Services every long-running grpod process uses — the daemon and the agent alike: structured
logging and the metrics log (`logs`), systemd's notify protocol and the watchdog heartbeat
(`notify`). Nothing here imports the daemon or the agent."""
