"""Ray Serve serving: Drafter deployments, the target Verifier, an OpenAI-compatible ingress.

``app.application(cfg)`` builds the application, ``app.run`` serves it (``taps serve``).
"""
