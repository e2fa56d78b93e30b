"""The expert-parallel worker kind: one worker served by a group of ranks.

Rank 0 (the leader) is the mesh's worker and drives a `GroupEngine` (`engine`), which sends each round's
commands to the follower ranks (`follower`) over the group's control channel (`channel`, codec in
`control`); `cache` routes the prefix-cache calls to the rank they concern.
"""
