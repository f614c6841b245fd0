"""The RL REST surface: what an agent's owner and the trainer call (``/rl``, ``/admin``).

Owns: runs and their config (``runs``), sessions with their rewards and ends (``sessions``),
admission, the staleness bound on how far generation runs ahead of training
(``admission``), the trainer's claims (``claims``) and steps (``steps``), publishing new
weights to the engines (``weights``), the REST bodies (``schemas``) and the routes
(``routes``).

Does not know: the OpenAI surfaces or how turns are sampled and recorded (``server.proxy``);
SQL (``server.store`` holds every query); how the trainer trains (it is a client over HTTP).
"""
