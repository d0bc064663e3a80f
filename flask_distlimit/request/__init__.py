"""One request's path, in the order a request meets its modules: ``enforcement`` (the app's
request path, wiring the rest), ``gate`` (where Flask calls the view), ``plans`` (a route's
limits, bound once), ``data`` (the request's record), ``checks`` (one check per limit),
``decide`` (the deny cache, a lease, or one storage call), ``refuse`` (429 and 503), then after
the response ``deduction``'s charges and the ``headers``; ``current_limits``, the limits in hand.
"""
