"""One request's path: the gate that decides every limit of a request in one storage call, the
response headers, charging after the response, and the request's limits in hand.
"""
