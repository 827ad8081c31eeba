"""The pool as data, and the pure decisions over it: the snapshot read from Redis (``snapshot``),
what the coordinator decides on it (``decide``, ``room``, ``autosize``), and the dry runs other
roles ask of the same decisions (``fit`` for the admin API, ``route_room`` for the router).

On the shared floor because more than one role needs it: the coordinator enforces these
decisions; web answers what they would do (a fit, a route's predicted wait) without importing
the coordinator."""
