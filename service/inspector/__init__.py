"""The built-in request inspector: GET /inspect and its JSON API under /inspect/api.

- recorder.py: what happened to each recent request and to the engine, recorded from what
  the pipeline already has (the Generation's telemetry, the engine's StepStats, log lines).
- requests.py: one recorded request (its outcome, times and the engine steps it shared).
- engine_window.py: the engine's last minutes, per second (sparklines, expert-load heatmap).
- log_ring.py: recent log lines by trace id.
- views.py: records -> the API's bodies (schemas.py), with the prompt-text policy.
- controller.py: the routes; static/: the page (plain HTML, JS and CSS, no build step).
"""
