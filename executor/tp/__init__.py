"""The tensor-parallel wing: which part of the model a rank holds (shards.py), the forward's
collectives (collectives.py), and the rank processes: their supervisor (rank_group.py), one rank
(rank.py), rank 0's side of the group (followers.py) and the other ranks' loop (follower.py)."""
