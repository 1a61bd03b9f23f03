//! The paged KV block allocator: a fixed pool of blocks handed out one at a time to the
//! sequences' block tables and returned when a sequence ends (end of stream, cancel, error).

/// A fixed pool of `num_blocks` KV blocks of `block_size` tokens.
///
/// Blocks are handed out LIFO from a free stack (the most recently freed block is reused
/// first: its memory is the warmest). Which block a sequence gets never changes its results:
/// the model addresses KV only through the block table.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    num_blocks: usize,
    free: Vec<u32>,
    /// `owned[b]`: block `b` is in some block table (catches double frees).
    owned: Vec<bool>,
}

impl BlockAllocator {
    /// A pool with every block free. `num_blocks` must fit u32 block ids.
    pub fn new(block_size: usize, num_blocks: usize) -> Result<BlockAllocator, String> {
        if block_size == 0 || num_blocks == 0 {
            return Err(format!(
                "KV pool of {num_blocks} blocks of {block_size} tokens is empty"
            ));
        }
        if num_blocks > u32::MAX as usize || block_size > u32::MAX as usize {
            return Err(format!(
                "KV pool of {num_blocks} blocks of {block_size} tokens does not fit u32 ids"
            ));
        }
        Ok(BlockAllocator {
            block_size,
            num_blocks,
            free: (0..num_blocks as u32).rev().collect(),
            owned: vec![false; num_blocks],
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks in block tables now.
    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free.len()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Append `n` blocks to `table`; all or nothing (`false`: too few free, nothing taken).
    pub fn grow(&mut self, table: &mut Vec<u32>, n: usize) -> bool {
        if n > self.free.len() {
            return false;
        }
        for _ in 0..n {
            let b = self.free.pop().unwrap_or_default();
            self.owned[b as usize] = true;
            table.push(b);
        }
        true
    }

    /// Return every block of `table` to the pool and empty it.
    ///
    /// A block not owned (a double free, an engine bug) is skipped rather than pushed twice,
    /// so the free stack can never hand one block to two sequences.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            match self.owned.get_mut(b as usize) {
                Some(o) if *o => {
                    *o = false;
                    self.free.push(b);
                }
                _ => debug_assert!(false, "KV block {b} freed twice or out of range"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_is_all_or_nothing_and_release_returns_everything() {
        let mut a = BlockAllocator::new(4, 3).unwrap();
        let (mut t1, mut t2) = (Vec::new(), Vec::new());
        assert!(a.grow(&mut t1, 2));
        assert!(!a.grow(&mut t2, 2), "only one block left");
        assert!(t2.is_empty());
        assert!(a.grow(&mut t2, 1));
        assert_eq!((a.free_blocks(), a.used_blocks()), (0, 3));
        let mut all: Vec<u32> = t1.iter().chain(&t2).copied().collect();
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2], "each block handed out once");
        a.release(&mut t1);
        assert!(t1.is_empty());
        assert_eq!((a.free_blocks(), a.used_blocks()), (2, 1));
        a.release(&mut t2);
        assert_eq!(a.free_blocks(), 3);
        assert_eq!(a.blocks_for(0), 0);
        assert_eq!(a.blocks_for(4), 1);
        assert_eq!(a.blocks_for(5), 2);
    }

    #[test]
    fn empty_pool_is_an_error() {
        assert!(BlockAllocator::new(0, 4).unwrap_err().contains("empty"));
        assert!(BlockAllocator::new(4, 0).is_err());
    }
}
