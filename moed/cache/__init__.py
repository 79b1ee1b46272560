"""The cache model: what the daemon serves and the lab replays, in one place.

Pure (standard library only: no I/O, no clocks, no asyncio), and below both the
daemon and the lab, which import it and never each other:

- `store`: the slot state machine and the one byte budget shared by every model
  and tenant (`Store`); the daemon drives it, the lab's tests replay through it;
- `records`: the records it works on (`Slot`, `SlotClass`, `ExpertKey`, `Want`,
  `Plan`), importable from `store` too;
- `room`: which slots give way to new bytes (`RoomSearch`), chosen and claimed
  before the store changes anything, all or nothing;
- `eviction`: the eviction policies behind one interface (`LRU`, `DecayingLFU`);
  the daemon's `eviction_policy` names one, and the lab's g-lru and lru replays,
  the fleet's byte-budget replay and the engines' estimate of the daemon's cache
  (moed.engines.cache_estimate) run the same `LRU` class;
- `quota`: a tenant's floor and ceiling, and the floor rule that decides whether
  a slot may be evicted for another tenant (the room search's quota walk and the
  lab's fleet replay both ask it).
"""
