// What a transport is: each library includes one (transport/ipc.cuh or transport/nvshmem.cuh), which
// defines `Net` in namespace epcomm::ll with
//   kReach                                    the peers it carries data to (Reach below)
//   put_warp / put_block(dst, src, bytes, pe) non-blocking copy of local `src` to `pe`'s copy of the
//                                             symmetric address `dst` (this rank's own), by a warp / block
//   signal(addr, value, pe)                   set `pe`'s copy of the 8-byte word `addr`, after every put
//                                             of this rank to `pe` that quiet() completed
//   quiet()                                   complete every put this rank issued
#pragma once

#include "../common/ptx.cuh"

namespace epcomm {

enum class Reach {
    kMappedPeers,  // only peers mapped into this process: every store is direct, Net's calls never run
    kAnyPeer,      // peers without a mapping too (other nodes), through Net's puts and signals
};

}  // namespace epcomm
